"""``engine.kv_cache_dtype: fp8``: the cache stores K/V in FP8 and attention reads them back.

The oracle is transformers with a cache that rounds each new K/V to the same FP8 type (as
our cache does when it stores them) before attending: greedy tokens must be equal, so a
wrong conversion, a skipped rounding or a misread byte shows as a different token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config_base import ConfigError
from common.engine_config import EngineConfig
from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError
from engine.models.fp8_maker import quantize_checkpoint
from kernels.reference import to_cache_dtype
from tests.engine.helpers import add_kv_scales, hf_greedy, random_prompts

NUM_TOKENS = 24
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_rounding_cache(dtype: torch.dtype, scales: dict[int, tuple[float, float]] | None = None):
    """``new_cache`` for ``hf_greedy``: a DynamicCache that stores (and attends to) K/V
    rounded through ``dtype``; with ``scales`` (layer -> (k_scale, v_scale)), K/V divided
    by their layer's scales, rounded, and multiplied back (a calibrated FP8 cache)."""
    from transformers import DynamicCache

    def rounded(states: torch.Tensor, scale: float) -> torch.Tensor:
        return to_cache_dtype(states / scale, dtype).to(states.dtype) * scale

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args: Any, **kwargs: Any):
            k_scale, v_scale = (scales or {}).get(layer_idx, (1.0, 1.0))
            key_states = rounded(key_states, k_scale)
            value_states = rounded(value_states, v_scale)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return lambda config: RoundingCache(config=config)


@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype"),
    [("llama", "fp8"), ("llama", "fp8_e5m2"), ("gemma3", "fp8"), ("gpt_oss", "fp8")],
)
def test_greedy_parity_with_transformers_rounding_its_cache(model_factory, arch, kv_cache_dtype):
    model_dir = model_factory(arch)
    prompts = random_prompts((5, 17, 40), seed=7)
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32)
    assert all(cache.dtype == FP8[kv_cache_dtype] for cache in llm.engine.runner.kv_caches)
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cache = fp8_rounding_cache(FP8[kv_cache_dtype])
    expected = hf_greedy(model_dir, prompts, NUM_TOKENS, new_cache=cache)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    # Not a vacuous check: the unrounded model parts from the rounded one on these prompts.
    assert hf_greedy(model_dir, prompts, NUM_TOKENS) != expected
    assert llm.engine.leak_report() == []


def test_an_fp8_cache_uses_the_checkpoints_calibrated_kv_scales(tiny_llama, tmp_path):
    """An FP8 checkpoint with per-layer ``k_scale`` / ``v_scale`` (llm-compressor's and
    ModelOpt's): the FP8 cache stores K / k_scale and V / v_scale, so the tokens are those
    of transformers with a cache rounding that way; a 32-bit cache ignores the scales."""
    model_dir = quantize_checkpoint(tiny_llama, tmp_path / "fp8", "fp8-block", (32, 64))
    # Not powers of two (those would round exactly as unscaled values do), one layer left
    # unscaled, and small enough that the largest K/V saturate at 448, as a scale
    # calibrated on other data may let them.
    scales = {0: (0.0137, 0.0291), 1: (0.0213, 0.0117), 3: (0.0079, 0.0173)}
    add_kv_scales(model_dir, scales)
    prompts = random_prompts((5, 17, 40), seed=7)
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    scaled = fp8_rounding_cache(torch.float8_e4m3fn, scales)
    expected = hf_greedy(model_dir, prompts, NUM_TOKENS, new_cache=scaled)
    with LLM(model_dir, dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.leak_report() == []
    assert [output.outputs[0].token_ids for output in outputs] == expected
    unscaled = fp8_rounding_cache(torch.float8_e4m3fn)
    assert hf_greedy(model_dir, prompts, NUM_TOKENS, new_cache=unscaled) != expected
    with LLM(model_dir, dtype="float32") as llm:  # a float32 cache: the scales are unused
        plain = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == hf_greedy(model_dir, prompts, NUM_TOKENS)
    # Per-head scales: an FP8 cache refuses them at start (a float32 cache loaded them).
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.01, 0.02])
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="per-head scales are not supported"):
        LLM(model_dir, dtype="float32", kv_cache_dtype="fp8")


def test_scales_no_layer_uses_are_told_apart_from_those_used(tiny_llama, tmp_path, caplog):
    """The log counted every layer that had scales as using them: a latent-attention
    (MLA) checkpoint's, which its layers never read, and a layer past the model's."""
    import logging

    model_dir = quantize_checkpoint(tiny_llama, tmp_path / "fp8", "fp8-block", (32, 64))
    add_kv_scales(model_dir, {0: (0.0137, 0.0291), 99: (0.02, 0.02)})
    with (caplog.at_level(logging.INFO, logger="engine.model_shard"),
          LLM(model_dir, dtype="float32", kv_cache_dtype="fp8") as llm):  # fmt: skip
        assert llm.engine.leak_report() == []
    messages = [r.getMessage() for r in caplog.records if r.name == "engine.model_shard"]
    assert any("calibrated K/V scales (1 of 4 layers)" in m for m in messages), messages
    assert any("K/V scales of 1 layers are unused" in m for m in messages), messages


def test_fp8_holds_four_times_the_float32_blocks(tiny_llama):
    """Same bytes, a quarter of the bytes per element: four times the blocks."""
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(tiny_llama, dtype="float32", kv_cache_bytes=1 << 22, max_model_len=256,
                 kv_cache_dtype=kv_cache_dtype) as llm:  # fmt: skip
            sizes[kv_cache_dtype] = llm.engine.runner.num_blocks
    assert sizes["fp8"] == 4 * sizes["auto"]


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ConfigError, match="kv_cache_dtype.*fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")
