"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): GQA attention whose q/k RMSNorm spans each token's
whole projection, a partial rotary, DeepSeek-V3's sigmoid router with a choice bias and no
groups or shared experts; log-probs equal transformers', the release layout read as
transformers reads it. (Greedy parity: ``test_parity``; split, with the norms' mean
squares summed across ranks: the TP tests.)"""

from __future__ import annotations

import json

import transformers

from common.kv_budget import ModelShape
from engine.models.arch import read_arch_config
from engine.parallel.shard_spec import split_widths
from tests.engine.helpers import assert_prompt_logprobs_match, random_prompts


def test_prompt_logprobs_equal_transformers(model_factory):
    assert_prompt_logprobs_match(model_factory("minimax_m2"), random_prompts()[7])


# MiniMax-M2's shape, as its config.json writes it (the rotary width as rotary_dim).
RELEASE_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "model_type": "minimax_m2",
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}


def test_release_layout_reads_as_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE_CONFIG))
    arch = read_arch_config(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (arch.num_q_heads, arch.num_kv_heads, arch.head_dim) == (48, 8, 128)
    rotary = text.rope_parameters["partial_rotary_factor"] * text.head_dim
    assert arch.rope.rotary_dim(arch.head_dim) == rotary == 64
    assert arch.rope.theta == text.rope_parameters["rope_theta"] == 5e6
    assert arch.qk_norm_whole and not arch.qk_norm and not arch.qkv_bias
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups) == (256, 8, 1)
    assert (moe.deepseek_scoring, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        "sigmoid", True, 1.0)  # fmt: skip
    assert (moe.expert_intermediate_size, moe.shared_expert_intermediate_size) == (1536, 0)
    assert all(moe.sparse_layers) and len(moe.sparse_layers) == 62
    shape = ModelShape.read(tmp_path)
    assert (shape.num_kv_heads, shape.head_dim) == (8, 128)
    assert dict(shape.split_widths) == split_widths(arch) == {"moe_intermediate_size": 1536}
