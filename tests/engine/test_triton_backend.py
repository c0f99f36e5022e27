"""The engine with ``attention_backend="triton"`` decodes exactly what the torch backend does.

Without CUDA the kernels run in Triton's interpreter (slow), so prompts are few and short;
a small token budget forces chunked prefill, so prompt chunks on a cached prefix share steps
with decodes.
"""

from __future__ import annotations

import json
import shutil

import pytest

import tests.kernels.triton_env  # noqa: F401  (sets TRITON_INTERPRET before kernels load)

# isort: split

from engine import LLM, SamplingParams
from engine.models.fp8_maker import quantize_checkpoint
from kernels.fused_moe import fused_moe
from tests.engine.helpers import add_kv_scales, random_prompts
from tests.kernels.triton_env import DEVICE

NUM_TOKENS = 6
# The fused MoE kernel is the slowest thing the interpreter runs (~0.5 s a layer a step):
# the MoE models decode fewer tokens, still past their prompts' chunks.
MOE_NUM_TOKENS = 3


def engine_llm(model_dir, backend: str, **overrides) -> LLM:
    return LLM(
        model_dir,
        attention_backend=backend,
        device=DEVICE.type,
        dtype="float32",
        max_num_batched_tokens=24,
        num_blocks=64,
        max_model_len=256,
        **overrides,
    )


def greedy(
    model_dir, backend: str, prompts: list[list[int]], num_tokens: int = NUM_TOKENS, **overrides
) -> list[list[int]]:
    return greedy_tokens(engine_llm(model_dir, backend, **overrides), prompts, num_tokens)


def greedy_tokens(
    llm: LLM, prompts: list[list[int]], num_tokens: int = NUM_TOKENS
) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.leak_report() == []
    return [output.outputs[0].token_ids for output in outputs]


def with_window(source, model_dir, window: int):
    """A copy of the checkpoint at ``source`` whose windowed layers see ``window`` tokens."""
    shutil.copytree(source, model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["sliding_window"] = window
    config_path.write_text(json.dumps(config))
    return model_dir


def test_triton_backend_matches_torch_backend(tiny_llama):
    prompts = random_prompts((3, 19, 40))
    prompts.append(prompts[2][:33] + [7, 8])  # shares two cached blocks with the previous one
    assert greedy(tiny_llama, "triton", prompts) == greedy(tiny_llama, "torch", prompts)


def test_triton_backend_with_an_fp8_kv_cache(tiny_llama, tmp_path):
    """The store's FP8 rounding and the kernel's FP8 reads, against the torch backend's, on
    an FP8 checkpoint whose calibrated K/V scales the cache stores over (the layer hands
    the store float32 K/V and the kernel a scaled softmax scale)."""
    model_dir = quantize_checkpoint(tiny_llama, tmp_path / "fp8", "fp8-block")
    add_kv_scales(model_dir, {0: (0.0137, 0.0291), 1: (0.0213, 0.0117), 3: (0.0079, 0.0173)})
    prompts = random_prompts((5, 30), seed=6)
    triton_tokens = greedy(model_dir, "triton", prompts, kv_cache_dtype="fp8")
    assert triton_tokens == greedy(model_dir, "torch", prompts, kv_cache_dtype="fp8")


def test_triton_backend_sliding_window(model_factory, tmp_path):
    """A Mistral checkpoint with a 12-token window: prompts and decodes run past it."""
    model_dir = with_window(model_factory("mistral"), tmp_path / "mistral-window", 12)
    prompts = random_prompts((9, 30), seed=1)
    assert greedy(model_dir, "triton", prompts) == greedy(model_dir, "torch", prompts)


@pytest.mark.parametrize("arch", ["qwen2_moe", "nemotron_h_latent"])
def test_triton_backend_runs_moe_models_with_the_fused_kernel(model_factory, arch):
    """Qwen2-MoE (routed experts and a shared expert), and Nemotron 3 Super's layout
    (ungated squared-ReLU experts in a latent space, between Mamba-2 and attention
    layers): the triton backend's fused MoE kernel decodes the torch backend's tokens."""
    model_dir = model_factory(arch)
    triton_llm = engine_llm(model_dir, "triton")
    layer = next(m for m in triton_llm.engine.runner.model.model.layers
                 if hasattr(getattr(m, "mlp", None), "fused"))  # fmt: skip
    assert layer.mlp.fused and layer.mlp._run_experts.func is fused_moe  # not the reference
    prompts = random_prompts((5, 21), seed=2)
    expected = greedy(model_dir, "torch", prompts, MOE_NUM_TOKENS)
    assert greedy_tokens(triton_llm, prompts, MOE_NUM_TOKENS) == expected


def test_triton_backend_gemma3(model_factory, tmp_path):
    """Gemma 3 hands the kernel a scale that is not head_dim ** -0.5 and a window on every
    other layer (12 tokens here, so prompts and decodes run past it)."""
    model_dir = with_window(model_factory("gemma3"), tmp_path / "gemma3-window", 12)
    prompts = random_prompts((9, 30), seed=3)
    assert greedy(model_dir, "triton", prompts) == greedy(model_dir, "torch", prompts)


def test_triton_backend_gemma3_images(model_factory, tmp_path):
    """Gemma 3's images: their tokens attend to each other both ways (the kernel's key
    ends), in 5-token chunks that each image grows to its end, under a 12-token window
    (shorter than an image: the window still bounds what an image token sees)."""
    from tests.engine.test_gemma3_images import IMAGES, PROMPT, windowed

    model_dir = windowed(model_factory("gemma3_mm"), tmp_path / "gemma3-mm-window", 12)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    expected = greedy(model_dir, "torch", prompts, prefill_chunk_tokens=5)
    assert greedy(model_dir, "triton", prompts, prefill_chunk_tokens=5) == expected


def test_triton_backend_gpt_oss(model_factory, tmp_path):
    """GPT-OSS: the kernel's attention sinks in decodes and prompt chunks, a 12-token window
    on every other layer; its experts (biases, clamped SwiGLU) in the fused MoE kernel."""
    model_dir = with_window(model_factory("gpt_oss"), tmp_path / "gpt-oss-window", 12)
    triton_llm = engine_llm(model_dir, "triton")
    layers = triton_llm.engine.runner.model.model.layers
    assert all(layer.mlp._run_experts.func is fused_moe for layer in layers)  # capturable
    prompts = random_prompts((9, 30), seed=4)
    expected = greedy(model_dir, "torch", prompts, MOE_NUM_TOKENS)
    assert greedy_tokens(triton_llm, prompts, MOE_NUM_TOKENS) == expected


def test_triton_backend_deepseek(model_factory):
    """DeepSeek-V3: decodes through the MLA decode kernel (the latents read from both cache
    slots), prompt chunks on a cached prefix through the shared torch path, the experts
    through the fused kernel with V3's float32 routing weights."""
    model_dir = model_factory("deepseek_v3")
    prompts = random_prompts((9, 30), seed=6)
    expected = greedy(model_dir, "torch", prompts, MOE_NUM_TOKENS)
    assert greedy(model_dir, "triton", prompts, MOE_NUM_TOKENS) == expected
