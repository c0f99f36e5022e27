"""DeepSeek-V2 / -V3: latent attention over a cache of one latent per token, their routers,
and the release config read as transformers reads it. (Greedy parity: ``test_parity``.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file

from benchmarks.speculative import ReplayProposer
from common.config_base import ConfigError
from common.engine_config import AttentionBackendName
from common.kv_budget import ModelShape
from common.tensor_parallel import split_problem
from engine import LLM, SamplingParams
from engine.attention.backend import LatentAttention
from engine.attention.registry import create_backend, resolve_backend_name
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.lora import load_lora_adapter
from engine.models.moe import DeepseekGate
from engine.parallel.shard_spec import split_widths
from kernels import reference
from tests.engine.helpers import assert_prompt_logprobs_match, hf_greedy, random_prompts
from tests.engine.test_disaggregation import run


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_prompt_logprobs_equal_transformers(model_factory, arch):
    """130 tokens: past V3's 64-token YaRN context, through both routers' group limits."""
    assert_prompt_logprobs_match(model_factory(arch), random_prompts()[7])


def test_a_v3_config_without_interleaved_rope(model_factory, tmp_path):
    """``rope_interleave: false``: the checkpoint's rotary rows are already in halves, and
    are loaded as stored (reordering them would move every log-prob)."""
    model_dir = tmp_path / "halves"
    model_dir.mkdir()
    for path in model_factory("deepseek_v3").iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    assert not read_arch_config(model_dir).mla.rope_interleaved
    assert_prompt_logprobs_match(model_dir, random_prompts()[6])


def test_the_cache_holds_one_latent_per_token(model_factory):
    """Each layer's cache is [blocks, 2, block_size, 1, (kv_lora_rank + rope) / 2]: the
    latent, split over the K and V slots; the KV budget check sizes it alike."""
    model_dir = model_factory("deepseek_v3")
    llm = LLM(model_dir, dtype="float32", num_blocks=300)
    shard = llm.engine.runner.shard
    config = json.loads((model_dir / "config.json").read_text())
    latent_dim = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert tuple(shard.kv_caches[0].shape) == (300, 2, 16, 1, latent_dim // 2)
    shape = ModelShape.read(model_dir)
    assert (shape.num_kv_heads, shape.head_dim) == (1, latent_dim // 2)
    assert shape.bytes_per_block(16, 4) == shard.bytes_per_block
    # What the same heads would cache as keys and values: per token and layer,
    # 2 x heads x (nope + rope) for K and V against one latent.
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert latent_dim < 2 * config["num_attention_heads"] * qk_head_dim


@pytest.mark.parametrize("version", [2, 3])
def test_router_chooses_and_weighs_as_transformers(model_factory, version):
    """Random tokens through DeepseekGate and transformers' router of the same weights:
    the same experts, the same weights (in float32)."""
    model_dir = model_factory(f"deepseek_v{version}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs = hf.model.layers[1].mlp.gate
    arch = read_arch_config(model_dir)
    ours = DeepseekGate(arch.moe, arch.hidden_size)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        if version == 3:
            ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    hidden = torch.randn(300, arch.hidden_size)
    with torch.no_grad():
        expert_ids, weights = ours(hidden)
        _, their_weights, their_ids = theirs(hidden)
    order, their_order = expert_ids.argsort(dim=-1), their_ids.argsort(dim=-1)
    assert torch.equal(expert_ids.gather(1, order), their_ids.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    if version == 3:  # the choice bias matters: without it other experts win somewhere
        with torch.no_grad():
            ours.e_score_correction_bias.zero_()
            unbiased, _ = ours(hidden)
        assert not torch.equal(unbiased.sort(dim=-1).values, expert_ids.sort(dim=-1).values)


def test_absorbed_and_expanded_forms_agree():
    """One prompt segment over a paged context of latents: the heads attending over the
    latents (absorbed) and over their expanded keys and values give the same output; and
    the cost model picks expanded for whole prompts, absorbed for decodes and for short
    chunks after a long context (DeepSeek-V3's dims: from ~170 query tokens)."""
    torch.manual_seed(0)
    heads, nope, rope, rank, v = 4, 32, 16, 48, 24
    latent = LatentAttention(torch.randn(heads, nope, rank) / 7, torch.randn(heads, v, rank) / 7,
                             rope)  # fmt: skip
    block_size, seq_len, query_len = 16, 70, 29
    kv_cache = torch.randn(8, 2, block_size, 1, (rank + rope) // 2)
    block_ids = torch.tensor([5, 0, 7, 2, 3])  # out of order, the last one partly used
    query = torch.randn(query_len, heads, nope + rope)
    expanded = reference.expanded_latent_attention(query, kv_cache, block_ids, seq_len, 0.1,
                                                   latent.expand)  # fmt: skip
    absorbed = reference.paged_attention(
        latent.absorb(query), kv_cache, torch.tensor([0, query_len]), torch.tensor([seq_len]),
        block_ids[None], 0.1, latent_dim=rank,
    )  # fmt: skip
    torch.testing.assert_close(latent.values(absorbed), expanded, atol=1e-5, rtol=1e-5)
    assert latent.expanded_is_cheaper(seq_len, seq_len)
    assert not latent.expanded_is_cheaper(1, seq_len)
    v3 = LatentAttention(torch.empty(128, 128, 512), torch.empty(128, 128, 512), 64)
    assert v3.expanded_is_cheaper(4096, 4096) and not v3.expanded_is_cheaper(1, 4096)
    assert not v3.expanded_is_cheaper(160, 10_000) and v3.expanded_is_cheaper(180, 10_000)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_multi_token_prediction_layers_are_left_unloaded(model_factory, arch):
    """V3's and GLM-4.5's checkpoints store their MTP module as one more layer
    (``model.layers.61`` of 61 in V3; the made ones store it too): without
    ``speculative_method: mtp`` it is skipped, as transformers skips it, and generation
    is unchanged. (Drafting with it: ``test_mtp.py``.)"""
    model_dir = model_factory(arch)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    stored = load_file(str(model_dir / "model.safetensors"))
    assert f"model.layers.{num_layers}.eh_proj.weight" in stored
    prompts = random_prompts((20, 70))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    llm = LLM(model_dir, dtype="float32")
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(model_dir, prompts, 8)
    assert len(llm.engine.runner.kv_caches) == num_layers
    assert not any("mtp" in name for name, _ in llm.engine.runner.model.named_parameters())


def test_chunked_prefill_and_cached_prefixes_give_the_same_tokens(model_factory):
    """Prompts prefilled in 24-token chunks, then again over their cached prefixes, in one
    batch with decodes: the tokens of one whole-prompt pass (transformers')."""
    model_dir = model_factory("deepseek_v2")
    prompts = random_prompts((40, 90, 130), seed=3)
    expected = hf_greedy(model_dir, prompts, 12)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    for _ in range(2):  # the second pass finds every full block cached
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[2].num_cached_tokens >= 112
    assert llm.engine.leak_report() == []


def test_verified_drafts_give_transformers_tokens(model_factory):
    """Speculative decoding: each decode with its drafts is a short query segment over the
    latents (the batched short-segment path), a quarter of the drafts wrong."""
    model_dir = model_factory("deepseek_v3")
    prompts = random_prompts((5, 33, 64), seed=4)
    expected = hf_greedy(model_dir, prompts, 20)
    engine = LLM(model_dir, dtype="float32", num_speculative_tokens=3).engine
    reference = {f"r{i}": tokens for i, tokens in enumerate(expected)}
    engine.scheduler.proposer = ReplayProposer(reference, 0.25, 2000, seed=1)
    params = SamplingParams(max_tokens=20, min_tokens=20, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = run(engine)
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert 0 < engine.scheduler.num_accepted_tokens < engine.scheduler.num_draft_tokens
    assert engine.leak_report() == []


def test_auto_keeps_latent_attention_on_torch_and_lora_is_refused(model_factory, tmp_path):
    """``auto`` on CUDA picks torch for MLA (its decode kernel is not measured on a GPU
    yet; ``triton`` asks for it); LoRA adapters on MLA models are refused at load."""
    cuda_auto = resolve_backend_name(AttentionBackendName.AUTO, torch.device("cuda"), True)
    assert cuda_auto is AttentionBackendName.TORCH
    asked = resolve_backend_name(AttentionBackendName.TRITON, torch.device("cuda"), True)
    assert asked is AttentionBackendName.TRITON
    # Latent widths its decode kernel cannot tile are refused at start, not at the first
    # decode step (an audit's tiny deepseek_v2: kv_lora_rank 96, rope 48).
    for widths in ((96, 48), (512, 8)):  # (8: tl.dot's inner dimension is 16 at least)
        with pytest.raises(ConfigError, match=f"this model's: {widths[0]} and {widths[1]}"):
            create_backend(AttentionBackendName.TRITON, torch.device("cuda"), 16, widths)
    arch = read_arch_config(model_factory("deepseek_v3"))
    with pytest.raises(ModelLoadError, match="LoRA adapters on models with latent attention"):
        load_lora_adapter("a", tmp_path, arch, torch.device("cpu"), torch.float32)


# deepseek-ai/DeepSeek-V3's config.json (transformers 4 layout, DeepSeek's own keys).
RELEASE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}  # fmt: skip


def test_release_config_reads_as_transformers_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE_CONFIG))
    arch = read_arch_config(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path)
    mla = arch.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (text.q_lora_rank, text.kv_lora_rank, text.qk_nope_head_dim,
                                text.qk_rope_head_dim, text.v_head_dim)  # fmt: skip
    assert (arch.num_kv_heads, arch.head_dim) == (1, 288)  # 576 elements per token and layer
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
    with torch.device("meta"):
        layer = attention(text, 0)
    assert arch.attention_scale == pytest.approx(layer.scaling)
    assert arch.attention_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (256, 8, 8, 4)
    assert (moe.expert_intermediate_size, moe.shared_expert_intermediate_size) == (2048, 2048)
    assert (moe.deepseek_scoring, moe.routed_scaling_factor, moe.norm_topk_prob) == (
        "sigmoid", 2.5, True)  # fmt: skip
    assert moe.sparse_layers == tuple(i >= 3 for i in range(61 + 1))  # and the MTP layer
    assert arch.num_mtp_layers == 1
    assert (arch.rope.rope_type, arch.rope.factor, arch.rotary_dim) == ("yarn", 40.0, 64)
    assert arch.max_context_len == 163840
    assert arch.fp8_weights is not None and arch.fp8_weights.block_size == (128, 128)
    shape = ModelShape.read(tmp_path)
    assert (shape.num_kv_heads, shape.head_dim) == (1, 288)
    # The KV budget check splits what the loader splits; V3 splits over 8 ranks, each
    # caching every latent (one replicated KV head).
    assert dict(shape.split_widths) == split_widths(arch)
    assert split_problem(128, shape.num_kv_heads, split_widths(arch), 8) is None
    assert shape.bytes_per_block(16, 2, tp_size=8) == shape.bytes_per_block(16, 2)
    # 70,272 bytes of bf16 cache per token (61 layers x 576), where the keys and values the
    # latents stand for would take 61 x 128 heads x (192 + 128) x 2 = 4,997,120.
    assert shape.bytes_per_block(16, 2) == 16 * 70_272
    odd = {**RELEASE_CONFIG, "qk_rope_head_dim": 63}
    (tmp_path / "config.json").write_text(json.dumps(odd))
    with pytest.raises(ModelLoadError, match="positive even number, got 575"):
        read_arch_config(tmp_path)


def test_v2_lite_config_has_no_q_lora_and_routes_greedily(tmp_path):
    """DeepSeek-V2-Lite's shape: one q_proj, softmax routing over all 64 experts."""
    lite = {**RELEASE_CONFIG, "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2", "q_lora_rank": None, "n_routed_experts": 64,
            "n_shared_experts": 2, "num_experts_per_tok": 6, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.0, "norm_topk_prob": False, "num_hidden_layers": 27,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                             "type": "yarn"}}  # fmt: skip
    del lite["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(lite))
    arch = read_arch_config(tmp_path)
    text = transformers.AutoConfig.from_pretrained(tmp_path)
    attention = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention
    with torch.device("meta"):
        layer = attention(text, 0)
    assert arch.attention_scale == pytest.approx(layer.scaling)
    assert arch.mla.q_lora_rank is None and arch.mla.rope_interleaved
    moe = arch.moe
    assert (moe.deepseek_scoring, moe.num_groups, moe.topk_groups) == ("softmax", 1, 1)
    assert moe.shared_expert_intermediate_size == 2 * 2048
    assert moe.sparse_layers == tuple(i >= 1 for i in range(27))
    lite["topk_method"] = "noaux_tc"
    (tmp_path / "config.json").write_text(json.dumps(lite))
    with pytest.raises(ModelLoadError, match="topk_method 'noaux_tc' is not supported"):
        read_arch_config(tmp_path)
