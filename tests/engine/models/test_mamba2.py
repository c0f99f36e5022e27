"""Mamba-2 models (``engine/models/mamba2.py``): Granite 4.0-H's layers between
rotary-free attention (and Granite 3's multipliers), Nemotron-H's one-block layers (and
Nemotron 3's experts): the SSM's chunked form against its recurrence, every prompt
position's log-probs against transformers' (whole, chunked, over ranks: a B/C group split
or copied, a norm group spanning ranks), decode log-probs, the released configs read as
transformers reads them and sized as the engine sizes them, two ranks as one, adapters of
Granite's attention. What every hybrid layout shares (prefix-cache snapshots, drafts,
preemption, disaggregation, 16-bit states) is tested over all of them in
``tests/engine/test_hybrid*.py``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config_base import ConfigError
from common.config_loader import load_config
from common.engine_config import EngineConfig
from common.kv_budget import ModelShape, kv_budgets
from common.tensor_parallel import mamba_split_problem
from deploy.config_cmd import summary
from engine import LLM, SamplingParams
from engine.linear_state import bytes_per_slot
from engine.llm_engine import LLMEngine
from engine.models.arch import ModelLoadError, arch_from_config, read_arch_config
from engine.models.lora import load_lora_adapter
from engine.models.lora_maker import make_lora_adapter
from engine.models.mamba2 import chunked_ssd, ssm_step
from engine.parallel.shard_spec import TensorParallel, local_arch
from tests.engine.helpers import assert_prompt_logprobs_match, hf_greedy, random_prompts
from tests.support.processes import write_config

HEADS, GROUPS, HEAD_DIM, STATE = 4, 2, 5, 3


def ssm_inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    decay = -torch.rand(length, HEADS, generator=generator) * 0.3  # log decays <= 0
    return (randn(length, HEADS, HEAD_DIM), decay, randn(length, GROUPS, STATE),
            randn(length, GROUPS, STATE), randn(HEADS, HEAD_DIM, STATE))  # fmt: skip


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 64), (64, 64), (130, 64), (37, 16)])
def test_chunked_ssd_equals_the_recurrence(length, chunk):
    """Partial and whole chunks, from a nonzero state, two heads per B/C group: every
    output and the final state."""
    x_dt, decay, b, c, state = ssm_inputs(length, length)
    out, final = chunked_ssd(x_dt, decay, b, c, state, chunk)
    b_heads, c_heads = (t.repeat_interleave(HEADS // GROUPS, 1) for t in (b, c))
    expected, current = [], state[None].clone()
    for t in range(length):
        step_out, current = ssm_step(x_dt[t : t + 1], decay[t : t + 1], b_heads[t : t + 1],
                                     c_heads[t : t + 1], current)  # fmt: skip
        expected.append(step_out[0])
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, current[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "arch,ranks",
    [("granite", ()), ("granite_hybrid", (2,)), ("granite_hybrid_dense", (2, 4)),
     ("nemotron_h", (2,)), ("bamba", (2,))],
)  # fmt: skip
def test_log_probs_equal_transformers(model_factory, arch, ranks):
    """Every prompt position, whole (three SSD chunks: 130 tokens) and in chunks of 9 (the
    states carried). Over ranks: granite_hybrid's one B/C group is copied on both ranks
    and its norm group spans them (squares summed across); granite_hybrid_dense's two
    groups split over 2 ranks, and over 4 each is shared by 2 ranks. Bamba: Granite's
    layers with rotary attention over half of each head."""
    model_dir = model_factory(arch)
    prompt = random_prompts([130], seed=4)[0]
    assert_prompt_logprobs_match(model_dir, prompt)
    assert_prompt_logprobs_match(model_dir, prompt, prefill_chunk_tokens=9)
    for size in ranks:
        assert_prompt_logprobs_match(model_dir, prompt[:50], tensor_parallel_size=size)


@pytest.mark.parametrize("arch", ["granite_hybrid", "nemotron_h"])
def test_decode_log_probs_equal_transformers(model_factory, arch):
    """Decodes (the one-token recurrence, states carried from step to step): tokens equal
    transformers' greedy ones, and each sampled token's log-prob its forward pass over
    the prompt and the tokens before it (1e-4). Nemotron-H clamps every time step at
    0.001; transformers' incremental decode skips that clamp (2e-4 off here), its forward
    pass does not, and neither does the engine in any path (prompts only fails this)."""
    from transformers import AutoModelForCausalLM

    model_dir = model_factory(arch)
    prompts = random_prompts([30, 70], seed=11)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0, logprobs=0)
    expected_tokens = hf_greedy(model_dir, prompts, 16, use_cache=False)  # the forward pass
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, tokens in zip(prompts, outputs, expected_tokens, strict=True):
        assert output.outputs[0].token_ids == tokens
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
        scores = logits[len(prompt) - 1 : -1].log_softmax(-1)
        expected = scores.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        got = [entry.logprob for entry in output.outputs[0].logprobs]
        assert got == pytest.approx(expected, abs=1e-4)
    assert llm.engine.leak_report() == []


def test_released_configs_read_as_transformers_reads_them(tmp_path):
    """A config as Granite 4.0-H's releases write it ("mamba" / "attention" layers,
    ``mamba_d_head`` "auto", keys left to their defaults) reads as transformers' full
    one; ``time_step_limit`` in either spelling of infinity; rotary positions only with
    ``position_embedding_type: rope``."""
    import transformers

    layers = ["mamba", "attention", "mamba", "mamba"]
    released = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 1, "layer_types": layers,
                "mamba_n_heads": 16, "mamba_d_head": "auto", "position_embedding_type": "nope",
                "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "logits_scaling": 8.0}  # fmt: skip
    full = transformers.GraniteMoeHybridConfig(**released).to_dict()
    archs = [arch_from_config(raw, tmp_path) for raw in (released, full)]
    for arch in archs:
        mamba = arch.mamba2
        assert mamba.layers == (True, False, True, True) and arch.kv_layers == (1,)
        assert (mamba.num_heads, mamba.head_dim, mamba.state_size) == (16, 32, 256)
        assert (mamba.num_groups, mamba.conv_kernel, mamba.norm_group_size) == (1, 4, 512)
        assert (mamba.dt_min, mamba.dt_max) == (0.0, float("inf"))
        assert arch.nope and arch.attention_scale == 0.0078125 and arch.logits_divisor == 8.0
        assert (arch.embedding_multiplier, arch.residual_multiplier) == (12.0, 0.22)
        assert arch.moe.num_experts == 8 and arch.moe.top_k == 2  # transformers' defaults
        assert arch.moe.expert_intermediate_size == 11008 and arch.intermediate_size == 0
        assert arch.moe.shared_expert_intermediate_size == 1024
        assert not arch.moe.shared_expert_gated and arch.moe.softmax_over_top_k
    limited = {**released, "time_step_limit": [0.001, {"__float__": "Infinity"}],
               "position_embedding_type": "rope", "num_local_experts": 0}  # fmt: skip
    arch = arch_from_config(limited, tmp_path)
    assert (arch.mamba2.dt_min, arch.mamba2.dt_max) == (0.001, float("inf"))
    assert not arch.nope and arch.moe is None and arch.intermediate_size == 1024
    for bad, message in (({"layer_types": ["mamba"] * 4}, "no attention layer"),
                         ({"time_step_limit": "x"}, "time_step_limit"),
                         ({"mamba_n_groups": 3}, "mamba_n_groups=3")):  # fmt: skip
        with pytest.raises(ModelLoadError, match=message):
            arch_from_config({**released, **bad}, tmp_path)


def test_bamba_configs_read_as_released(tmp_path):
    """Bamba-9B's released config (transformers 4's keys: ``rope_theta`` alone, the rotary
    fraction fixed in its config class): attention layers by ``attn_layer_indices``,
    Granite 4.0-H's Mamba-2 keys, rotary over half of each head, the usual softmax
    scale, no multipliers; as transformers 5 writes it too."""
    import transformers

    released = {"architectures": ["BambaForCausalLM"], "model_type": "bamba",
                "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 6,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
                "attn_layer_indices": [2, 5], "mamba_n_heads": 16, "mamba_d_head": "auto",
                "mamba_d_state": 32, "rope_theta": 10000.0}  # fmt: skip
    full = transformers.BambaConfig(**released).to_dict()
    for raw in (released, full):
        arch = arch_from_config(raw, tmp_path)
        assert arch.kv_layers == (2, 5) and arch.linear_layers == (0, 1, 3, 4)
        mamba = arch.mamba2
        assert (mamba.num_heads, mamba.head_dim, mamba.state_size, mamba.num_groups) == (
            16, 32, 32, 1)  # fmt: skip
        assert arch.rope.rotary_dim(64) == 32 and not arch.nope  # half of a 64-wide head
        assert arch.attention_scale == pytest.approx(64**-0.5)
        assert (arch.embedding_multiplier, arch.residual_multiplier) == (1.0, 1.0)
        assert arch.intermediate_size == 512 and arch.moe is None


def test_nemotron_h_configs_read_as_released(model_factory, tmp_path):
    """Nemotron-H's released config: the layers as ``hybrid_override_pattern``, the Mamba-2
    layers' own key names, defaults for the rest; MLP layers keep no cache (the config
    check's KV block is the attention layers' alone); its expert layers (latent too)."""
    import transformers

    released = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 6,
                "hybrid_override_pattern": "M-M*-M", "mamba_num_heads": 16,
                "ssm_state_size": 32, "time_step_min": 0.002, "head_dim": 64}  # fmt: skip
    full = transformers.NemotronHConfig(**released).to_dict()
    for raw in (released, full):
        arch = arch_from_config(raw, tmp_path)
        assert arch.block_kinds == ("mamba", "mlp", "mamba", "attention", "mlp", "mamba")
        assert arch.kv_layers == (3,) and arch.linear_layers == (0, 2, 5)
        mamba = arch.mamba2
        assert (mamba.num_heads, mamba.head_dim, mamba.state_size, mamba.num_groups) == (
            16, 64, 32, 8)  # fmt: skip
        assert (mamba.dt_min, mamba.dt_max, mamba.norm_group_size) == (0.002, float("inf"), 128)
        assert arch.nope and arch.hidden_act == "relu2" and arch.intermediate_size == 21504
        assert (arch.num_q_heads, arch.num_kv_heads, arch.rms_norm_eps) == (32, 8, 1e-5)
    moe = arch_from_config({**released, "hybrid_override_pattern": "MEM*EM"}, tmp_path).moe
    assert moe.sparse_layers == (False, True, False, False, True, False)
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 2, 7688)
    assert moe.expert_activation == "relu2" and moe.deepseek_scoring == "sigmoid"
    assert moe.shared_expert_intermediate_size == 7688 and not moe.shared_expert_gated
    assert moe.latent_size is None
    latent = arch_from_config({**released, "hybrid_override_pattern": "MEM*EM",
                               "moe_latent_size": 64}, tmp_path).moe  # fmt: skip
    assert latent.latent_size == 64  # Nemotron 3 Super's
    model_dir = model_factory("nemotron_h")
    shape, engine = ModelShape.read(model_dir), LLMEngine(model_dir, EngineConfig())
    assert shape.bytes_per_block(16, 4) == engine.runner.bytes_per_block
    assert shape.rank_state_bytes() == bytes_per_slot(engine.arch.linear_attention)


@pytest.mark.parametrize("arch", ["nemotron_h_moe", "nemotron_h_latent"])
def test_nemotron_3_experts_equal_transformers(model_factory, arch):
    """Nemotron 3's expert layers: ungated squared-ReLU experts behind DeepSeek-V3's router
    (sigmoid scores, a choice-only bias, groups, scaled weights) beside an ungated shared
    expert; Nemotron 3 Super's run in a latent space half the hidden width (projected
    into it after the router, back after their weighted sum). Every prompt position's
    log-probs equal transformers', whole, chunked, over 2 ranks (each a slice of every
    expert's width, its partial sums projected back before the all-reduce) and with
    expert parallelism (whole experts per rank)."""
    model_dir = model_factory(arch)
    prompt = random_prompts([90], seed=5)[0]
    assert_prompt_logprobs_match(model_dir, prompt, prefill_chunk_tokens=13)
    assert_prompt_logprobs_match(model_dir, prompt[:50], tensor_parallel_size=2)
    assert_prompt_logprobs_match(model_dir, prompt[:50], tensor_parallel_size=2,
                                 expert_parallel=True)  # fmt: skip


def test_the_config_check_sizes_the_states_as_each_rank_holds_them(model_factory, tmp_path):
    """``pdserve config check``'s torch-free arithmetic equals the engine's per-rank state
    size (a copied B/C group counted on every rank); splits the groups cannot make are
    refused."""
    for name in ("granite_hybrid", "granite_hybrid_dense", "nemotron_h"):
        model_dir = model_factory(name)
        arch, shape = read_arch_config(model_dir), ModelShape.read(model_dir)
        for size in (1, 2, 4):
            local = local_arch(arch, TensorParallel(size, size - 1))
            assert shape.rank_state_bytes(size) == bytes_per_slot(local.linear_attention)
            assert shape.linear_split_problem(size) is None
        assert "do not split over 16 ranks" in shape.linear_split_problem(16)
    model_dir = model_factory("granite_hybrid")
    spec = {"kv_cache_bytes": 8 << 20, "max_num_seqs": 6, "device": "cpu",
            "num_speculative_tokens": 2}  # fmt: skip
    engine = LLMEngine(model_dir, EngineConfig(**spec))
    config = write_config(tmp_path / "config.yaml", model_dir, engine=spec)
    loaded = load_config(str(config))
    (prefill, _) = kv_budgets(loaded)
    assert prefill.num_blocks == engine.runner.num_blocks
    # ``pdserve config check`` prints the slots it reserves: 6 x (1 + 2), as the engine
    shard = engine.runner.shard
    assert (prefill.state_slots, prefill.state_bytes_per_slot) == (
        shard.num_state_slots, bytes_per_slot(engine.arch.linear_attention))  # fmt: skip
    lines = summary(loaded, [prefill])
    assert any(line.startswith("states    prefill: 18 slots") for line in lines)
    # Two groups of draft slots, not one per request: 6 + 2 x 2 slots, as the engine.
    few = {**spec, "max_num_verifying_seqs": 2}
    config = write_config(tmp_path / "config.yaml", model_dir, engine=few)
    (prefill, _) = kv_budgets(load_config(str(config)))
    assert (
        prefill.state_slots
        == 10
        == LLMEngine(model_dir, EngineConfig(**few)).runner.shard.num_state_slots
    )
    with pytest.raises(ConfigError, match="max_num_verifying_seqs"):
        EngineConfig(max_num_seqs=6, max_num_verifying_seqs=7)
    # A CPU tier too small for one snapshot beside a block is named (a warning: its KV
    # could serve no request); one that holds them is not.
    snapshot_bytes = shard.blocks_per_slot * shard.bytes_per_block
    for tier_bytes, warned in ((snapshot_bytes, True), (snapshot_bytes + shard.bytes_per_block,
                                                         False)):  # fmt: skip
        config = write_config(tmp_path / "config.yaml", model_dir, engine=spec,
                              offload={"cpu_bytes": tier_bytes})  # fmt: skip
        (prefill, _) = kv_budgets(load_config(str(config)))
        assert any("no snapshot of this model's" in w for w in prefill.warnings) is warned
    # (groups, heads, ranks): groups split or divide the ranks; heads split
    for groups, heads, size in ((1, 8, 2), (2, 8, 4), (4, 8, 2), (8, 8, 8)):
        assert mamba_split_problem(groups, heads, size) is None
    for groups, heads, size in ((3, 12, 2), (2, 6, 4), (1, 6, 4)):
        assert "Mamba-2 heads" in mamba_split_problem(groups, heads, size)


def test_two_ranks_give_one_ranks_tokens(model_factory):
    """Each rank its heads' states (and a copy of the one B/C group): chunked, preempted,
    from a snapshot (on the device, then loaded from every rank's CPU tier), and with
    drafts verified (every rank keeping its heads' states after each token)."""
    from benchmarks.speculative import ReplayProposer

    model_dir = model_factory("granite_hybrid")
    prompts = random_prompts([30, 41, 25, 37], seed=7)
    params = SamplingParams(max_tokens=30, min_tokens=30, temperature=0)
    one = LLM(model_dir)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    short, few = random_prompts([20], seed=8), SamplingParams(max_tokens=4, temperature=0)
    expected_short = one.generate(short, few, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model_dir, tensor_parallel_size=2, prefill_chunk_tokens=9, num_blocks=30,
             block_size=8, max_model_len=96, num_speculative_tokens=3,
             cpu_offload_bytes=8 << 20) as two:  # fmt: skip
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert got == expected and two.engine.scheduler.num_preemptions > 0
        first, again = (two.generate(short, few, use_tqdm=False)[0] for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected_short
        assert again.num_cached_tokens == 16  # from the snapshot after 16 tokens
        scheduler = two.engine.scheduler
        num_loads = scheduler.num_state_loads
        two.generate(prompts[2:], params, use_tqdm=False)  # evicts it
        (loaded,) = two.generate(short, few, use_tqdm=False)
        assert loaded.outputs[0].token_ids == expected_short
        assert loaded.num_cached_tokens == 16 and scheduler.num_state_loads == num_loads + 1
        scheduler.proposer = ReplayProposer({"drafted": expected[1]}, 0.3, 2000)
        two.engine.add_request("drafted", prompts[1], params)
        outputs = {}
        while two.engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in two.engine.step() if o.finished)
        assert outputs["drafted"].outputs[0].token_ids == expected[1]
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
        assert two.engine.leak_report() == []


def peft_log_probs(model_dir, adapter, prompt: list[int]) -> tuple[torch.Tensor, float]:
    """transformers + peft's log-probs at every prompt position but the last, and how far
    the adapter moved them from the base model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        unadapted = base(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        adapted = PeftModel.from_pretrained(base, str(adapter))(torch.tensor([prompt]))
    adapted = adapted.logits[0, :-1].log_softmax(-1)
    return adapted, (adapted - unadapted).abs().max().item()


def assert_adapter_log_probs(llm: LLM, prompt: list[int], reference: torch.Tensor) -> None:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5)
    (output,) = llm.generate([prompt], params, use_tqdm=False, lora_name=["a"])
    for position, lp in enumerate(output.prompt_logprobs[1:]):
        assert lp.logprob == pytest.approx(reference[position][lp.token_id].item(), abs=1e-4)
    assert llm.engine.leak_report() == []


ADAPTED = {
    "granite_hybrid": {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj"},
    "granite_hybrid_dense": {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj",
                             "input_linear", "output_linear"},
    # (PEFT refuses out_proj on Nemotron-H: its CUDA kernel path would skip an adapter
    # there. The engine applies one as PEFT's torch path does.)
    "nemotron_h": {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"},
    "bamba": {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "gate_proj",
              "up_proj", "down_proj"},
}  # fmt: skip


@pytest.mark.parametrize("arch", list(ADAPTED))
def test_adapters_give_peft_log_probs_over_ranks_too(model_factory, tmp_path, arch):
    """Granite 4.0-H's adapters of its attention, its Mamba-2 layers (``mamba.in_proj``
    whole: z, x, B, C and time-step rows; ``out_proj``) and, where it stands alone
    (``granite_hybrid_dense``, H-Micro's layout), its shared MLP (``input_linear``, gate
    and up rows; ``output_linear``); Nemotron-H's of each layer's one block (PEFT's
    ``backbone.layers.{i}.mixer``: Mamba-2, attention, or its ungated MLP's ``up_proj``
    and ``down_proj``); Bamba's (Granite's names, its MLP ``feed_forward``): every
    prompt position's log-probs equal transformers + peft's
    (which differ from the base's), chunked, and over two ranks (each cutting B's rows of
    ``in_proj`` as its weight's: its heads' z, x and time steps, its B/C groups or a copy
    of the one group)."""
    model_dir = model_factory(arch)
    adapter = make_lora_adapter(model_dir, tmp_path / "a", seed=3, targets=sorted(ADAPTED[arch]))
    adapted = {key.split(".")[-3] for key in load_file(adapter / "adapter_model.safetensors")}
    assert adapted == ADAPTED[arch]
    prompt = random_prompts([40], seed=4)[0]
    reference, moved = peft_log_probs(model_dir, adapter, prompt)
    assert moved > 0.1  # the adapter changes the model
    llm = LLM(model_dir, dtype="float32", lora_adapters={"a": adapter}, prefill_chunk_tokens=15)
    assert_adapter_log_probs(llm, prompt, reference)
    with LLM(model_dir, dtype="float32", lora_adapters={"a": adapter},
             tensor_parallel_size=2) as two:  # fmt: skip
        assert_adapter_log_probs(two, prompt, reference)


def test_adapters_where_there_is_no_such_module_are_refused(model_factory, tmp_path):
    """Beside experts Granite's shared MLP is their shared expert (refused, as experts'
    MLPs are anywhere); an attention layer has no Mamba-2 projection; Nemotron 3's
    expert layers have no MLP of their own."""
    model_dir = model_factory("granite_hybrid")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter = make_lora_adapter(model_dir, tmp_path / "a", seed=3, targets=targets)
    arch = read_arch_config(model_dir)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = "base_model.model.model.layers.0.shared_mlp.input_linear"
    tensors[f"{key}.lora_A.weight"] = torch.zeros(8, arch.hidden_size)
    tensors[f"{key}.lora_B.weight"] = torch.zeros(2 * arch.intermediate_size, 8)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match="mixture-of-experts layer; LoRA on its MLP"):
        load_lora_adapter("bad", adapter, arch, torch.device("cpu"), torch.float32)
    attention_layer = next(i for i in range(arch.num_layers) if not arch.is_linear(i))
    tensors = {k: v for k, v in tensors.items() if ".shared_mlp." not in k}
    key = f"base_model.model.model.layers.{attention_layer}.mamba.in_proj"
    tensors[f"{key}.lora_A.weight"] = torch.zeros(8, arch.hidden_size)
    tensors[f"{key}.lora_B.weight"] = torch.zeros(16, 8)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match="has no mamba.in_proj"):
        load_lora_adapter("bad", adapter, arch, torch.device("cpu"), torch.float32)
    model_dir = model_factory("nemotron_h_moe")
    arch = read_arch_config(model_dir)
    adapter = make_lora_adapter(model_dir, tmp_path / "n", seed=3)
    adapted = load_file(adapter / "adapter_model.safetensors")
    assert not any(".up_proj." in key for key in adapted)  # every MLP is experts here
    assert load_lora_adapter("n", adapter, arch, torch.device("cpu"), torch.float32).layers
    moe_layer = arch.block_kinds.index("moe")
    key = f"base_model.model.backbone.layers.{moe_layer}.mixer.up_proj"
    adapted[f"{key}.lora_A.weight"] = torch.zeros(8, arch.hidden_size)
    adapted[f"{key}.lora_B.weight"] = torch.zeros(16, 8)
    save_file(adapted, adapter / "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match=f"layer {moe_layer} \\(moe\\) has no mixer.up_proj"):
        load_lora_adapter("n", adapter, arch, torch.device("cpu"), torch.float32)
