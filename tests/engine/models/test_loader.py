"""Checkpoint loading: configurations beyond the maker's, shards, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError, read_arch_config
from tests.engine.helpers import hf_greedy, random_prompts

SMALL = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
)

VARIANTS = {
    "mistral-sliding-window": (transformers.MistralConfig, {"sliding_window": 24}),
    "llama-bias-linear-rope": (
        transformers.LlamaConfig,
        {
            "attention_bias": True,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
    "qwen3-mqa-head32": (
        transformers.Qwen3Config,
        {"num_key_value_heads": 1, "head_dim": 32},
    ),
    "qwen2-untied-sliding-upper-layers": (
        transformers.Qwen2Config,
        {
            "tie_word_embeddings": False,
            "use_sliding_window": True,
            "sliding_window": 20,
            "max_window_layers": 1,
        },
    ),
    "llama-tied-head128": (
        transformers.LlamaConfig,
        {"tie_word_embeddings": True, "num_attention_heads": 2, "head_dim": 128},
    ),
}


def write_checkpoint(
    out: Path, tokenizer_from: Path, config_cls, dtype=torch.float32, shard=None, **overrides
) -> Path:
    config = config_cls(**{**SMALL, **overrides})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_on_architecture_variants(variant, tiny_llama, tmp_path):
    config_cls, overrides = VARIANTS[variant]
    model_dir = write_checkpoint(tmp_path, tiny_llama, config_cls, **overrides)
    prompts = random_prompts((5, 30, 50, 71))
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 24)
    assert llm.engine.leak_report() == []


def test_sharded_bf16_checkpoint(tiny_llama, tmp_path):
    model_dir = write_checkpoint(
        tmp_path, tiny_llama, transformers.Qwen2Config, dtype=torch.bfloat16, shard="200KB"
    )
    assert (model_dir / "model.safetensors.index.json").exists()
    prompts = random_prompts((9, 64))
    llm = LLM(model_dir, dtype="float32")  # float32 compute from bf16 weights
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, min_tokens=16, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 16)


def test_legacy_rope_scaling_keys_are_read(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_arch_config(tmp_path).rope == read_arch_config(tiny_llama).rope


def test_missing_and_unsupported_are_named(tiny_llama, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        LLM(broken)
    config = json.loads((tiny_llama / "config.json").read_text())
    for case, (key, value, message) in enumerate(
        (
            ("architectures", ["GPT2LMHeadModel"], "GPT2LMHeadModel.*not supported"),
            ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1.0}, "yarn.*not supported"),
            ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor"),
            ("hidden_act", "gelu_pytorch_tanh", "hidden_act.*not supported"),
            ("quantization_config", {"quant_method": "awq"}, r"quantized.*\(awq\)"),
        )
    ):
        odd = tmp_path / f"odd-{case}"
        shutil.copytree(tiny_llama, odd)
        (odd / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ModelLoadError, match=message):
            LLM(odd)
    fewer = tmp_path / "fewer-layers-in-weights"
    shutil.copytree(tiny_llama, fewer)
    (fewer / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    with pytest.raises(ModelLoadError, match=r"missing from the checkpoint.*layers\.4"):
        LLM(fewer)


def test_config_keys_left_out_take_transformers_defaults(tiny_llama, tmp_path):
    """config.json written with use_diff leaves out keys equal to transformers' defaults:
    Mistral's 4096-token window, Qwen's max_window_layers=28, llama3's original context
    (= max_position_embeddings); with no architectures, model_type names the class."""
    config = json.loads((tiny_llama / "config.json").read_text())
    config.pop("sliding_window", None)
    cases = {
        "mistral": ({**config, "architectures": ["MistralForCausalLM"]}, "sliding_windows",
                    (4096,) * config["num_hidden_layers"]),
        "qwen": ({**config, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                  "sliding_window": 64}, "sliding_windows", (None,) * config["num_hidden_layers"]),
        "no-architectures": ({**config, "architectures": None, "model_type": "qwen3"},
                             "architecture", "Qwen3ForCausalLM"),
        "llama3": ({**config, "max_position_embeddings": 777, "rope_parameters": {
                    "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0}}, "rope", None),
    }  # fmt: skip
    for name, (values, field, expected) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(values))
        arch = read_arch_config(tmp_path / name)
        if name == "llama3":
            assert arch.rope.original_max_position_embeddings == 777
        else:
            assert getattr(arch, field) == expected, name


def test_a_tied_config_with_a_different_stored_head_uses_it_as_transformers_does(
    tiny_llama, tmp_path
):
    from safetensors.torch import load_file, save_file

    model_dir = write_checkpoint(
        tmp_path, tiny_llama, transformers.LlamaConfig, tie_word_embeddings=True
    )
    weights = load_file(model_dir / "model.safetensors")
    torch.manual_seed(2)
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"]) * 0.2
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts((5, 40))
    llm = LLM(model_dir, dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 12)
