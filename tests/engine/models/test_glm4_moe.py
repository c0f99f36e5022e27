"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``): GQA attention with q/k/v biases, q/k norms and a
partial rotary, DeepSeek-V3's router; log-probs equal transformers', the release layout
read as transformers reads it. (Greedy parity: ``test_parity``; split: TP tests.)"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from common.kv_budget import ModelShape
from engine.models.arch import read_arch_config
from engine.parallel.shard_spec import split_widths
from tests.engine.helpers import assert_prompt_logprobs_match, random_prompts


def test_prompt_logprobs_equal_transformers(model_factory):
    assert_prompt_logprobs_match(model_factory("glm4_moe"), random_prompts()[7])


# GLM-4.5-Air's shape, in the transformers 4 layout its config.json is written in.
AIR_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 151329,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_qk_norm": False,
    "vocab_size": 151552,
}


@pytest.mark.parametrize("qk_norm", [False, True])  # Air has none, GLM-4.5 has them
def test_release_layout_reads_as_transformers_reads_it(tmp_path, qk_norm):
    (tmp_path / "config.json").write_text(json.dumps({**AIR_CONFIG, "use_qk_norm": qk_norm}))
    arch = read_arch_config(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (arch.num_q_heads, arch.num_kv_heads, arch.head_dim) == (96, 8, 128)
    assert arch.rope.rotary_dim(arch.head_dim) == 64 and arch.rope.theta == 1e6
    assert arch.mla is None and arch.qk_norm is qk_norm
    assert arch.qkv_bias and not arch.o_bias  # q/k/v biased, o_proj not
    with torch.device("meta"):
        attention = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeAttention(text, 0)
    assert attention.o_proj.bias is None and attention.q_proj.bias is not None
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (128, 8, 1, 1)
    assert (moe.deepseek_scoring, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        "sigmoid", True, 1.0)  # fmt: skip
    assert (moe.expert_intermediate_size, moe.shared_expert_intermediate_size) == (1408, 1408)
    assert moe.sparse_layers == tuple(i >= 1 for i in range(46 + 1))  # and the MTP layer
    assert arch.num_mtp_layers == 1
    assert arch.eos_token_ids == (151329, 151336, 151338)
    shape = ModelShape.read(tmp_path)
    assert (shape.num_kv_heads, shape.head_dim) == (8, 128)
    assert dict(shape.split_widths) == split_widths(arch)
