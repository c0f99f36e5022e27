"""Rotary tables equal transformers' for every rope type read (its own init functions are
the oracle), and a model with YaRN scaling decodes transformers' tokens."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from common.config_base import ConfigError
from common.kv_budget import ModelShape
from engine import LLM, SamplingParams
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.rope import RotaryEmbedding, inverse_frequencies
from tests.engine.helpers import hf_greedy, random_prompts
from tests.engine.models.test_loader import SMALL, write_checkpoint

HEAD_DIM = 64
CONFIGS = {
    "llama3": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}),
    "linear": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
    # Qwen2.5 / Qwen3's long-context setting (legacy rope_scaling, as their READMEs give it).
    "yarn-qwen": (transformers.Qwen2Config, {"rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        "rope_theta": 1e6}),
    # DeepSeek-style: no factor (the context's growth), mscale ratio, other betas.
    "yarn-mscale": (transformers.LlamaConfig, {"max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": None,
        "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707,
        "beta_fast": 16, "beta_slow": 2}}),
    "yarn-attention-factor-untruncated": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "attention_factor": 0.9,
        "original_max_position_embeddings": 100, "truncate": False}}),
    # Phi-4-mini: 3/4 of each head rotates.
    "phi3-partial": (transformers.Phi3Config, {"partial_rotary_factor": 0.75,
                                               "rope_theta": 1e4}),
}  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_tables_equal_transformers(name, tmp_path):
    config_cls, overrides = CONFIGS[name]
    config = config_cls(**{**SMALL, "head_dim": HEAD_DIM, **overrides})
    config.save_pretrained(tmp_path)
    rope = read_arch_config(tmp_path).rope
    rope_type = config.rope_parameters["rope_type"]
    assert rope.rope_type == rope_type
    if rope_type == "default":  # transformers 5 keeps it on each model's rotary class
        expected, scaling = Phi3RotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    ours = inverse_frequencies(rope, HEAD_DIM)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(scaling, rel=1e-12)
    # cos/sin carry the attention factor, over the rotary dims only.
    rotary = RotaryEmbedding(rope, HEAD_DIM, max_positions=8)
    rotary.build_tables(torch.device("cpu"))
    positions = torch.arange(8, dtype=torch.float32)[:, None] * expected.float()[None, :]
    emb = torch.cat((positions, positions), dim=-1)
    torch.testing.assert_close(rotary.cos, emb.cos() * scaling)
    torch.testing.assert_close(rotary.sin, emb.sin() * scaling)


@pytest.mark.parametrize("name", ["yarn-qwen", "yarn-mscale"])
def test_yarn_models_decode_transformers_tokens(name, tiny_llama, tmp_path):
    """Prompts and outputs run past the 64/128-token pretraining context the tables are
    stretched from; log-probs equal transformers', which greedy tokens alone could miss."""
    config_cls, overrides = CONFIGS[name]
    model_dir = write_checkpoint(tmp_path, tiny_llama, config_cls, **overrides)
    assert json.loads((model_dir / "config.json").read_text())["rope_parameters"]["factor"] != 1
    prompts = random_prompts((40, 130))
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 24)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([prompts[1]])).logits[0, :-1].log_softmax(-1)
    for position, lp in enumerate(outputs[1].prompt_logprobs[1:]):
        assert lp.logprob == pytest.approx(reference[position, lp.token_id].item(), abs=1e-4)
    assert llm.engine.leak_report() == []


def test_legacy_phi_config_reads_its_top_level_rotary_keys(tmp_path):
    """Phi-4-mini's config.json (transformers 4) keeps partial_rotary_factor at the top
    level; its old rope names "su" and "yarn" mean longrope (refused), not YaRN."""
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **SMALL,
              "rope_theta": 1e4, "partial_rotary_factor": 0.75, "rope_scaling": None}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    rope = read_arch_config(tmp_path).rope
    assert (rope.partial_rotary_factor, rope.rotary_dim(64)) == (0.75, 48)
    assert transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters == {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75
    }  # fmt: skip
    for old_name in ("su", "yarn"):
        scaling = {"type": old_name, "short_factor": [1.0] * 24, "long_factor": [2.0] * 24}
        (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
        with pytest.raises(ModelLoadError, match="rope type 'longrope' is not supported"):
            read_arch_config(tmp_path)


def test_yarn_extends_the_served_context(tiny_llama, tmp_path):
    """Qwen2.5's configs keep max_position_embeddings at the pretraining length and enable
    4x with YaRN: the engine, the KV budget and the router serve 4x (as vLLM does); a prompt
    past the unscaled length decodes transformers' tokens."""
    overrides = {"max_position_embeddings": 32, "rope_theta": 1e6,
                 "rope_scaling": {"type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 32}}  # fmt: skip
    model_dir = write_checkpoint(tmp_path / "model", tiny_llama, transformers.Qwen2Config,
                                 **overrides)  # fmt: skip
    assert read_arch_config(model_dir).max_context_len == 128
    assert ModelShape.read(model_dir).max_context_len == 128
    llm = LLM(model_dir, dtype="float32")
    assert llm.engine.max_model_len == 128
    prompts = random_prompts((100,))
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    (output,) = llm.generate(prompts, params, use_tqdm=False)
    assert [output.outputs[0].token_ids] == hf_greedy(model_dir, prompts, 16)
    with pytest.raises(ConfigError, match="1000 is beyond the model's context of 128"):
        LLM(model_dir, dtype="float32", max_model_len=1000)  # (a config error, as in vLLM)


def test_linear_scaling_extends_the_served_context_and_a_legacy_block_replaces_the_new(
    tiny_llama, tmp_path
):
    """Linear scaling was held at max_position_embeddings (vicuna-7b-v1.5-16k: 4,096 of its
    16,384; vLLM multiplies by the factor). And a legacy ``rope_scaling`` added to a
    transformers-5 config was merged key by key into its ``rope_parameters``: the default
    rotary with a factor. transformers 5 takes ``rope_scaling`` whole; so does the engine,
    whose tokens past the unscaled length are transformers' (an audit for both)."""
    linear = {"max_position_embeddings": 32, "rope_scaling": {"type": "linear", "factor": 4.0}}
    model_dir = write_checkpoint(tmp_path / "linear", tiny_llama, transformers.LlamaConfig,
                                 **linear)  # fmt: skip
    assert read_arch_config(model_dir).max_context_len == 128
    assert ModelShape.read(model_dir).max_context_len == 128
    model_dir = write_checkpoint(tmp_path / "both", tiny_llama, transformers.Qwen2Config,
                                 max_position_embeddings=32)  # fmt: skip
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32}  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(model_dir).rope_parameters["rope_type"] == "yarn"
    arch = read_arch_config(model_dir)
    assert (arch.rope.rope_type, arch.max_context_len) == ("yarn", 128)
    llm = LLM(model_dir, dtype="float32")
    prompts = random_prompts((60,))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    (output,) = llm.generate(prompts, params, use_tqdm=False)
    assert [output.outputs[0].token_ids] == hf_greedy(model_dir, prompts, 8)
