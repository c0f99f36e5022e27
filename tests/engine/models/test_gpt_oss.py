"""GPT-OSS: log-probs equal transformers', MXFP4 experts dequantized exactly (transformers'
own dequantizer is the oracle), the release config read as transformers reads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from common.kv_budget import ModelShape
from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.gpt_oss_weights import FP4_VALUES, dequantize_mxfp4
from tests.engine.helpers import assert_prompt_logprobs_match, hf_greedy, random_prompts

NUM_TOKENS = 24


def test_prompt_logprobs_equal_transformers(model_factory):
    """A 130-token prompt: past the 64-token window and the 64-token YaRN context; sinks,
    biases and the clamped SwiGLU all move log-probs that greedy tokens may not."""
    assert_prompt_logprobs_match(model_factory("gpt_oss"), random_prompts()[7])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8): each
    group of 32 scaled by a power of two so its largest value fits FP4's 6, then rounded
    to the nearest code (a test-side encoder; the engine only decodes)."""
    groups = weight.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    peak = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    values = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble first
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantizer_equals_transformers():
    torch.manual_seed(0)
    weight = torch.randn(3, 40, 64) * torch.logspace(-3, 2, 40)[None, :, None]
    blocks, scales = quantize_mxfp4(weight)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [3, 40, 64]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 64, 40]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).bfloat16(), ours)
    # The encoder is close (so the checkpoint below is a fair model): within half of FP4's
    # largest step (2, between 4 and 6) at each group's scale, which maps its peak to <= 6.
    error = (ours.float() - weight).abs().unflatten(-1, (-1, 32))
    peak = weight.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert error.le(peak / 3 + 1e-30).all()


def _mxfp4_checkpoint(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """The model with its expert weights in MXFP4, as OpenAI ships GPT-OSS, and the same
    model unquantized holding the dequantized weights (transformers' layout)."""
    quantized, dequantized = out / "mxfp4", out / "dequantized"
    shutil.copytree(model_dir, quantized)
    shutil.copytree(model_dir, dequantized)
    tensors = load_file(str(model_dir / "model.safetensors"))
    packed, plain = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # output-major, as shipped
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            restored = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            plain[name] = restored.contiguous()  # [E, in, out] again
        else:
            packed[name] = plain[name] = tensor
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(plain, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


def test_mxfp4_checkpoint_runs_its_dequantized_weights(model_factory, tmp_path):
    quantized, dequantized = _mxfp4_checkpoint(model_factory("gpt_oss"), tmp_path)
    prompts = random_prompts((9, 40, 90))
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    got = LLM(quantized, dtype="float32").generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in got]
    # transformers on the dequantized weights: the MXFP4 path loaded exactly those.
    assert tokens == hf_greedy(dequantized, prompts, NUM_TOKENS)
    original = LLM(model_factory("gpt_oss"), dtype="float32")
    unquantized = [o.outputs[0].token_ids for o in original.generate(prompts, params)]
    assert tokens != unquantized  # quantization changed the weights: the check can fail


def test_mxfp4_blocks_without_scales_are_refused(model_factory, tmp_path):
    quantized, _ = _mxfp4_checkpoint(model_factory("gpt_oss"), tmp_path)
    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"down_proj_blocks has no .*down_proj_scales"):
        LLM(quantized, dtype="float32")


# openai/gpt-oss-20b's config.json (transformers 4 layout), layer_types cut to its 24 layers.
RELEASE_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}


def test_a_config_leaving_keys_to_transformers_defaults(tmp_path):
    """What GptOssConfig fills in (kv heads, head_dim, eps, context, windows, YaRN) is read
    alike by the engine and by the router's and KV budget's reader (no torch there)."""
    sparse = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
              "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
              "vocab_size": 201088, "intermediate_size": 2880, "num_local_experts": 32,
              "num_experts_per_tok": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(sparse))
    arch = read_arch_config(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps) == (
        text.num_key_value_heads, text.head_dim, text.rms_norm_eps
    )  # fmt: skip
    assert arch.sliding_windows == tuple(
        text.sliding_window if kind == "sliding_attention" else None for kind in text.layer_types
    )
    assert (arch.rope.rope_type, arch.rope.factor) == ("yarn", text.rope_parameters["factor"])
    assert arch.max_context_len == text.max_position_embeddings == 131072
    shape = ModelShape.read(tmp_path)
    assert (shape.num_kv_heads, shape.head_dim, shape.max_context_len) == (8, 64, 131072)


def test_release_config_reads_as_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE_CONFIG))
    arch = read_arch_config(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (arch.num_layers, arch.num_q_heads, arch.num_kv_heads, arch.head_dim) == (
        text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
        text.head_dim,
    )  # fmt: skip
    assert arch.sliding_windows == tuple(
        text.sliding_window if kind == "sliding_attention" else None for kind in text.layer_types
    )
    assert arch.qkv_bias and arch.o_bias and arch.attention_sinks
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (32, 4, 2880)
    assert (moe.swiglu_limit, moe.swiglu_alpha, moe.softmax_over_top_k) == (7.0, 1.702, True)
    rope = arch.rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.truncate) == ("yarn", 150000.0, 32.0,
                                                                       False)  # fmt: skip
    assert rope.original_max_position_embeddings == 4096
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    assert arch.eos_token_ids == (200002,)
    other = {**RELEASE_CONFIG, "quantization_config": {"quant_method": "hqq"}}
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(ModelLoadError, match=r"quantized checkpoints \(hqq\)"):
        read_arch_config(tmp_path)
