"""Gemma 3: logits equal transformers' (what greedy parity cannot see), the multimodal
checkpoint served for text, configs that rely on transformers' defaults, and refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from common.hf_config import read_text_config
from common.kv_budget import ModelShape
from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.lora_maker import make_lora_adapter
from engine.models.rope_config import RopeConfig
from tests.engine.helpers import (
    assert_prompt_logprobs_match,
    gemma3_multimodal_checkpoint,
    hf_greedy,
    random_prompts,
    save_plain_target_adapter,
)

NUM_TOKENS = 24


def test_prompt_logprobs_equal_transformers(model_factory):
    """Beyond greedy tokens: the exact GELU, both rotary bases and the window all move the
    log-probs (a prompt of 130 tokens spans two 64-token windows)."""
    assert_prompt_logprobs_match(model_factory("gemma3"), random_prompts()[7])


def test_final_logit_softcapping(model_factory, tmp_path):
    """Gemma 2-style logit soft-capping (Gemma 3 configs may set it): tanh-capped logits."""
    model_dir = tmp_path / "softcap"
    shutil.copytree(model_factory("gemma3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["final_logit_softcapping"] = 3.0  # low enough to reshape the distribution
    (model_dir / "config.json").write_text(json.dumps(config))
    assert read_arch_config(model_dir).final_logit_softcap == 3.0
    assert_prompt_logprobs_match(model_dir, random_prompts()[4])


def test_multimodal_checkpoint_serves_text(model_factory, tmp_path):
    text_dir = model_factory("gemma3")
    model_dir = gemma3_multimodal_checkpoint(text_dir, tmp_path / "gemma3-mm")
    names = json.loads((model_dir / "config.json").read_text())
    assert names["architectures"] == ["Gemma3ForConditionalGeneration"]
    arch = read_arch_config(model_dir)
    assert arch.architecture == "Gemma3ForConditionalGeneration"
    text_arch = read_arch_config(text_dir)
    assert arch == dataclasses.replace(
        text_arch, architecture=arch.architecture, vision=arch.vision
    )
    prompts = random_prompts()[2:6]
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(model_dir, prompts, NUM_TOKENS)  # transformers' multimodal class
    for output, reference in zip(outputs, expected, strict=True):
        assert output.outputs[0].token_ids == reference
    assert llm.engine.leak_report() == []
    # The router and the KV budget read the nested text_config too.
    assert ModelShape.read(model_dir) == ModelShape(
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        max_context_len=arch.max_context_len,
        num_q_heads=arch.num_q_heads,
        split_widths=(("intermediate_size", arch.intermediate_size),),
        vocab_size=arch.vocab_size,
    )


def _assert_adapter_equals_peft(model_dir: Path, adapter: Path) -> None:
    prompts = random_prompts()[1:4]
    llm = LLM(model_dir, dtype="float32", lora_adapters={"tuned": adapter})
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_name="tuned")
    tuned = [o.outputs[0].token_ids for o in outputs]
    assert tuned == hf_greedy(model_dir, prompts, NUM_TOKENS, adapter_dir=adapter)
    assert tuned != hf_greedy(model_dir, prompts, NUM_TOKENS)  # the adapter changes tokens
    assert llm.engine.leak_report() == []


def test_adapter_on_the_multimodal_checkpoint_equals_peft(model_factory, tmp_path):
    """PEFT names a multimodal base's text layers ``model.language_model.layers``; an
    adapter written that way (``make_lora_adapter`` does, with a target regex that keeps
    PEFT off the vision tower) decodes what transformers + peft decode."""
    model_dir = gemma3_multimodal_checkpoint(model_factory("gemma3"), tmp_path / "gemma3-mm")
    adapter = make_lora_adapter(model_dir, tmp_path / "adapter", rank=4, seed=5)
    _assert_adapter_equals_peft(model_dir, adapter)


def test_peft_adapter_with_plain_targets_on_the_multimodal_checkpoint(model_factory, tmp_path):
    """``target_modules=["q_proj", ...]`` makes PEFT wrap the vision tower's projections
    too; serving text never runs them, so they are left out and the text model's adapter
    decodes what transformers + peft decode."""
    model_dir = gemma3_multimodal_checkpoint(model_factory("gemma3"), tmp_path / "gemma3-mm")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapter = save_plain_target_adapter(base, tmp_path / "adapter")
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        assert any(".vision_tower." in key for key in f.keys())  # noqa: SIM118
    _assert_adapter_equals_peft(model_dir, adapter)


# gemma-3-4b-it's config.json. Its text_config names six keys; transformers fills the rest
# with Gemma3TextConfig's defaults.
HUB_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
# gemma-3-1b-it's: transformers 4's layout, a local rope base and a window pattern.
HUB_1B_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}


HUB_CONFIGS = {
    "4b": HUB_4B_CONFIG,
    "1b": HUB_1B_CONFIG,
    # Variations transformers reads differently than the first guess would: the top level
    # ties the head whatever text_config says; another local base and window pattern.
    "4b-text-untied": {
        **HUB_4B_CONFIG,
        "text_config": {**HUB_4B_CONFIG["text_config"], "tie_word_embeddings": False},
    },
    "1b-local-base": {**HUB_1B_CONFIG, "rope_local_base_freq": 20000, "sliding_window_pattern": 3},
}


@pytest.mark.parametrize("hub_config", HUB_CONFIGS.values(), ids=HUB_CONFIGS.keys())
def test_hub_configs_read_as_transformers_reads_them(tmp_path, hub_config):
    (tmp_path / "config.json").write_text(json.dumps(hub_config))
    arch = read_arch_config(tmp_path)
    parsed = transformers.AutoConfig.from_pretrained(tmp_path)
    text = parsed.get_text_config()
    assert arch.architecture == hub_config["architectures"][0]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers
    )  # fmt: skip
    assert (arch.num_q_heads, arch.num_kv_heads, arch.head_dim) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim
    )  # fmt: skip
    assert arch.attention_scale == text.query_pre_attn_scalar**-0.5
    assert arch.max_position_embeddings == text.max_position_embeddings
    assert arch.tie_word_embeddings == parsed.tie_word_embeddings
    windows = tuple(
        text.sliding_window if kind == "sliding_attention" else None for kind in text.layer_types
    )
    assert arch.sliding_windows == windows
    for kind, rope in zip(text.layer_types, arch.layer_ropes, strict=True):
        params = text.rope_parameters[kind]
        assert rope == RopeConfig(
            theta=float(params["rope_theta"]),
            rope_type=params["rope_type"],
            factor=float(params.get("factor", 1.0)),
            original_max_position_embeddings=text.max_position_embeddings,
        )
    assert arch.eos_token_ids == (1, 106)
    # The KV budget check reads the same shape without torch.
    shape = ModelShape.read(tmp_path)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        arch.num_layers, arch.num_kv_heads, arch.head_dim
    )  # fmt: skip
    assert read_text_config(tmp_path)["sliding_window"] == text.sliding_window


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"layer_types": ["full_attention"]}, "1 layer_types for 26 layers"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope type 'longrope'"),
    ],
)
def test_unsupported_gemma3_configs_are_refused(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**HUB_1B_CONFIG, **change}))
    with pytest.raises(ModelLoadError, match=message):
        read_arch_config(tmp_path)
