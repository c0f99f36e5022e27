"""Tensor parallelism with real processes (gloo on CPU): the same tokens as one process and
as transformers, LoRA and the CPU tier on every rank, failures that end cleanly, and no
process outliving its engine."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from common.engine_config import EngineConfig
from common.owned_paths import remove_dead_owners
from engine import LLM, LLMEngine, PoolingParams, SamplingParams
from engine.attention.registry import create_backend
from engine.errors import InvalidRequestError
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.fp8_maker import quantize_checkpoint
from engine.models.loader import load_model
from engine.models.moe import SparseMoe
from engine.parallel.expert_placement import loaded_placement, rank_slots
from engine.parallel.shard_client import ShardError
from tests.engine.helpers import (
    add_kv_scales,
    headless_copy,
    hf_greedy,
    hf_last_logits,
    random_prompts,
)
from tests.support.polling import eventually
from tests.support.processes import is_running

NUM_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
POOL = dict(dtype="float32", kv_cache_bytes=32 << 20)


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize(
    ("arch", "tp_size"),
    [("llama", 2), ("qwen2_moe", 2), ("gpt_oss", 2), ("gemma3", 2), ("deepseek_v3", 2),
     ("deepseek_v2", 4), ("glm4_moe", 2), ("minimax_m2", 2), ("minimax_m2", 4)],
)  # fmt: skip
def test_greedy_parity_with_transformers(model_factory, arch, tp_size):
    """qwen2_moe: experts, a gated shared expert and q/k/v biases split; gpt_oss: sinks,
    an o_proj bias and expert biases (rank 0's only), windows; gemma3: each block's
    output normed after the all-reduce (sandwich norms); deepseek: latent attention's
    heads split (one head per rank for V2) with the latent replicated, shared experts
    ungated, the router in float32 on every rank; glm4_moe: q/k norms and a partial rotary
    per head, q/k/v biases split; minimax_m2: q/k norms over whole projections, their mean
    squares summed across ranks (at TP 4 each KV head is on two ranks)."""
    model_dir = model_factory(arch)
    prompts = random_prompts((5, 33, 71))
    with LLM(model_dir, tensor_parallel_size=tp_size, **POOL) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.leak_report() == []
    assert _tokens(outputs) == hf_greedy(model_dir, prompts, NUM_TOKENS)


@pytest.mark.parametrize(
    ("arch", "tp_size"), [("qwen2_moe", 2), ("gpt_oss", 2), ("deepseek_v3", 2), ("qwen3_moe", 4)]
)
def test_expert_parallel_greedy_parity_with_transformers(model_factory, arch, tp_size):
    """``expert_parallel``: each rank holds 8 / N whole experts (and runs only the tokens
    routed to them) while attention and the shared experts stay split; qwen2_moe: a gated
    shared expert beside them; gpt_oss: expert biases, each added by its expert's rank;
    deepseek_v3: group-limited routing over all experts on every rank."""
    model_dir = model_factory(arch)
    prompts = random_prompts((5, 33, 71))
    with LLM(model_dir, tensor_parallel_size=tp_size, expert_parallel=True, **POOL) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        sparse = [layer.mlp for layer in llm.engine.runner.model.model.layers
                  if hasattr(layer.mlp, "experts")]  # fmt: skip
        assert sparse and {m.experts.gate_up_proj.shape[0] for m in sparse} == {8 // tp_size}
        width = llm.engine.runner.model.arch.moe.expert_intermediate_size
        assert sparse[0].experts.down_proj.shape[2] == width  # whole, not cut
        assert llm.engine.leak_report() == []
    assert _tokens(outputs) == hf_greedy(model_dir, prompts, NUM_TOKENS)


@pytest.mark.parametrize(
    ("arch", "tp_size", "redundant"), [("qwen2_moe", 2, 2), ("gpt_oss", 2, 2), ("qwen3_moe", 4, 4)]
)
def test_rebalanced_experts_keep_the_tokens(model_factory, arch, tp_size, redundant):
    """Redundant experts, rebalanced every 2 steps while the requests run: the experts
    the ranks exchange (GPT-OSS's biases with them) and the pairs their copies share give
    transformers' tokens; rank 0's slots then hold the checkpoint's experts that the
    placement names."""
    model_dir = model_factory(arch)
    prompts = random_prompts((5, 33, 71))
    balanced = dict(expert_parallel=True, num_redundant_experts=redundant,
                    expert_rebalance_interval=2)  # fmt: skip
    with LLM(model_dir, tensor_parallel_size=tp_size, **balanced, **POOL) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        runner = llm.engine.runner
        balance = runner.expert_balance
        assert balance.num_rebalances == llm.engine.num_steps // 2
        assert balance.num_moved_slots > 0
        assert balance.imbalance_rebalanced <= balance.imbalance
        placements = runner.shard.expert_placements()
        assert placements != [loaded_placement(8, redundant, tp_size)] * len(placements)
        rank0 = runner.shard.moe_layers
        assert llm.engine.leak_report() == []
    assert _tokens(outputs) == hf_greedy(model_dir, prompts, NUM_TOKENS)
    cpu = torch.device("cpu")
    full = load_model(model_dir, read_arch_config(model_dir), 256,
                      create_backend("torch", cpu, 16), cpu, torch.float32)  # fmt: skip
    full_moes = [m for m in full.modules() if isinstance(m, SparseMoe)]
    for moe, whole, placement in zip(rank0, full_moes, placements, strict=True):
        for slot, expert in enumerate(rank_slots(placement, 0, tp_size)):
            for name, param in moe.experts.named_parameters():
                assert torch.equal(param[slot], getattr(whole.experts, name)[expert]), name


def test_an_fp8_checkpoint_splits_its_dequantized_weights(model_factory, tmp_path):
    """Block-scaled FP8 experts and projections (blocks that cut across the rank
    boundaries of k/v and the expert widths) give one process's tokens over 2 ranks, with
    an FP8 KV cache over the checkpoint's calibrated K/V scales on every rank."""
    model_dir = quantize_checkpoint(model_factory("qwen3_moe"), tmp_path / "fp8", "fp8-block",
                                    block_size=(48, 80))  # fmt: skip
    add_kv_scales(model_dir, {0: (0.0137, 0.0291), 1: (0.0213, 0.0117), 3: (0.0079, 0.0173)})
    prompts = random_prompts((5, 40))
    fp8_cache = {**POOL, "kv_cache_dtype": "fp8"}
    with LLM(model_dir, **fp8_cache) as llm:
        expected = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(model_dir, tensor_parallel_size=2, **fp8_cache) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert llm.engine.leak_report() == []


def test_a_vocabulary_that_does_not_split_evenly(model_factory, tmp_path):
    """2051 ids over 2 ranks: rank 1's embedding and head slices end in a zero padding row
    whose logit is cut off; tied and untied heads."""
    for tied in (False, True):
        model_dir = _odd_vocabulary_model(model_factory("llama"), tmp_path / f"tied-{tied}", tied)
        prompts = random_prompts((7, 40), seed=11, vocab=2051)
        params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, logprobs=3)
        # Token logits (a reranker's) across the split: ids at both slices' ends.
        ids = (0, 1025, 1026, 2050)
        with LLM(model_dir, tensor_parallel_size=2, **POOL) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            scored = llm.embed(prompts, PoolingParams(token_ids=ids), use_tqdm=False)
            embed = llm.engine.runner.model.model.embed_tokens
            assert (embed.rows, embed.weight.shape[0]) == (1026, 1026)
        assert _tokens(outputs) == hf_greedy(model_dir, prompts, 12), f"tied={tied}"
        for output, logits in zip(scored, hf_last_logits(model_dir, prompts), strict=True):
            torch.testing.assert_close(output.embedding, logits[list(ids)], atol=1e-4, rtol=1e-4)
        assert all(len(t.top_token_ids) == 3 for o in outputs for t in o.outputs[0].logprobs)
    # The untied one without its head (an embedding checkpoint's files): rank 1 pads a
    # head it never got, and the ranks' embeddings are one process's.
    bare = headless_copy(tmp_path / "tied-False", tmp_path / "bare")
    expected = [o.embedding for o in LLM(bare, **POOL).embed(prompts, use_tqdm=False)]
    with LLM(bare, tensor_parallel_size=2, **POOL) as llm:
        split = [o.embedding for o in llm.embed(prompts, use_tqdm=False)]
        with pytest.raises(InvalidRequestError, match="embeddings only"):
            llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(split, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _odd_vocabulary_model(tokenizer_from, out, tied: bool):
    import shutil

    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2051, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # well-separated logits: greedy parity is stable under rounding
        model.lm_head.weight.mul_(8)
    model.save_pretrained(out)
    for path in tokenizer_from.iterdir():
        if path.name.startswith("tokenizer"):
            shutil.copy(path, out / path.name)
    return out


def test_replicated_kv_heads_and_prompt_logprobs_match_one_process(model_factory):
    """tp 4 over 2 KV heads: each KV head on two ranks. Log-probs and embeddings (a step
    with no logits pass on any rank) agree to rounding (the partial sums add in another
    order)."""
    model_dir = model_factory("llama")
    prompts = random_prompts((40, 90), seed=3)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logprobs=2,
                            prompt_logprobs=2)  # fmt: skip
    one = LLM(model_dir, **POOL)
    single = one.generate(prompts, params, use_tqdm=False)
    single_vectors = [o.embedding for o in one.embed(prompts, use_tqdm=False)]
    with LLM(model_dir, tensor_parallel_size=4, **POOL) as llm:
        split = llm.generate(prompts, params, use_tqdm=False)
        split_vectors = [o.embedding for o in llm.embed(prompts, use_tqdm=False)]
        assert llm.engine.leak_report() == []
    for got, want in zip(split_vectors, single_vectors, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert _tokens(split) == _tokens(single)
    pairs = []
    for a, b in zip(split, single, strict=True):
        pairs += zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
        pairs += zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
    assert len(pairs) == 39 + 89 + 2 * 8
    for got, want in pairs:
        assert (got.token_id, got.top_token_ids) == (want.token_id, want.top_token_ids)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)


def test_lora_adapters_on_every_rank(model_factory, tmp_path):
    """Startup and runtime adapters give one process's tokens in one mixed batch; an
    unloaded adapter is dropped by every rank once no request holds it."""
    from engine.models.lora_maker import make_lora_adapter as make_lora

    model_dir = model_factory("llama")
    first = make_lora(model_dir, tmp_path / "a", seed=1)
    second = make_lora(model_dir, tmp_path / "b", seed=2)
    prompts = random_prompts((9, 30, 60), seed=5)
    names = [None, "first", "second"]
    reference = LLM(model_dir, lora_adapters={"first": first, "second": second}, **POOL)
    expected = _tokens(reference.generate(prompts, GREEDY, use_tqdm=False, lora_name=names))
    assert len({tuple(t) for t in expected}) == 3  # the adapters change the output
    with LLM(model_dir, lora_adapters={"first": first}, tensor_parallel_size=2, **POOL) as llm:
        assert llm.load_lora_adapter("second", second)
        got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_name=names)
        assert _tokens(got) == expected
        assert llm.unload_lora_adapter("second")
        gc.collect()
        assert llm.engine.leak_report() == []  # rank 1 dropped "second" too
        assert [r.num_adapters for r in llm.engine.runner.shards.probe()] == [1]


def test_an_adapter_another_rank_cannot_read_is_refused_everywhere(model_factory, tmp_path):
    from engine.models.lora_maker import make_lora_adapter as make_lora

    model_dir = model_factory("llama")
    adapter_dir = make_lora(model_dir, tmp_path / "a", seed=1)
    with LLM(model_dir, tensor_parallel_size=2, **POOL) as llm:
        engine = llm.engine
        adapter = engine.read_lora_adapter("a", adapter_dir)  # rank 0 read it ...
        (adapter_dir / "adapter_model.safetensors").write_bytes(b"not safetensors")
        with pytest.raises(InvalidRequestError, match="rank 1"):  # ... rank 1 cannot
            engine.add_lora_adapter(adapter)
        assert "a" not in engine.runner.lora_adapters
        del adapter
        gc.collect()
        assert engine.leak_report() == []


def test_cpu_tier_copies_every_ranks_blocks(model_factory):
    """A prefix evicted to the CPU tier and loaded back: if any rank's copy were missing,
    its heads would read stale KV and the tokens would change."""
    from tests.engine.test_cpu_tier import run

    model_dir = model_factory("llama")
    prefix = random_prompts((160,), seed=91)[0]
    fillers = random_prompts((200, 200, 200), seed=92)
    question = prefix + [7, 8, 9]
    pool = EngineConfig(dtype="float32", num_blocks=24, max_model_len=256)
    (expected,) = run(LLMEngine(model_dir, pool), [question], "q")
    engine = LLMEngine(model_dir, pool.replace(tensor_parallel_size=2, cpu_offload_bytes=16 << 20))
    try:
        run(engine, [prefix + [1, 2, 3]], "warm")
        run(engine, fillers, "fill")
        (out,) = run(engine, [question], "q")
        assert engine.cpu_tier.stats.hit_blocks == 10 and out.num_cached_tokens == 160
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert [r.num_host_slots for r in engine.runner.shards.probe()] == [
            engine.cpu_tier.num_blocks
        ]
        assert engine.leak_report() == []
    finally:
        engine.close()


def test_a_dead_rank_fails_the_engine_instead_of_hanging(model_factory):
    llm = LLM(model_factory("llama"), tensor_parallel_size=2, **POOL)
    try:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        (pid,) = llm.engine.runner.shards.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((ShardError, RuntimeError)):  # gloo: "connection closed by peer"
            llm.generate(random_prompts((50,)), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
        shards = llm.engine.runner.shards
        while shards.failure is None and time.monotonic() - start < 10:
            time.sleep(0.05)  # the watcher looks every 0.2 s
        assert shards.failure == "tensor-parallel rank 1 exited with code -9"
        with pytest.raises(ShardError, match="rank 1 exited"):  # and says so from now on
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_shards_stop_with_their_engine_and_only_then(model_factory, tmp_path, monkeypatch):
    """Signals meant for the worker (a Ctrl-C or SIGTERM to its process group) leave its
    ranks stepping; closing stops them, gives the process its torch threads back (each
    engine divided what the one before had left), and the engine then says it is
    closed. One nobody closed stops its ranks when collected, even while its caller
    holds one of its adapters (whose finalizer held the engine's ranks alive)."""
    from engine.models.lora_maker import make_lora_adapter as make_lora

    model_dir = model_factory("llama")
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    try:
        llm = LLM(model_dir, tensor_parallel_size=2, **POOL)
        assert torch.get_num_threads() == 2  # this rank's share
    finally:
        torch.set_num_threads(threads)
    (closed_pid,) = llm.engine.runner.shards.pids
    socket_dir = Path(llm.engine.runner.shards._dir)
    for signum in (signal.SIGINT, signal.SIGTERM):
        os.kill(closed_pid, signum)
    time.sleep(0.3)
    assert is_running(closed_pid)
    assert _tokens(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False))
    torch.set_num_threads(4)
    try:
        llm.close()
        assert torch.get_num_threads() == 4  # given back
    finally:
        torch.set_num_threads(threads)
    llm.close()  # idempotent
    assert not is_running(closed_pid) and not socket_dir.exists()
    with pytest.raises(ShardError, match="the engine is closed"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    forgotten = LLM(model_dir, tensor_parallel_size=2, **POOL)  # never closed
    (pid,) = forgotten.engine.runner.shards.pids
    socket_dir = Path(forgotten.engine.runner.shards._dir)
    adapter = forgotten.engine.read_lora_adapter("a", make_lora(model_dir, tmp_path / "a"))
    forgotten.engine.add_lora_adapter(adapter)  # and kept by the caller
    del forgotten
    gc.collect()
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(pid) and not socket_dir.exists()


def test_a_step_rank_0_left_half_done_takes_the_group_out_of_service(model_factory):
    """An exception on rank 0 after a step went out (a Ctrl-C in a notebook) leaves the
    other ranks inside that step: any later step would pair its collectives with the
    wrong ones, so every later call fails instead of returning other tokens."""
    llm = LLM(model_factory("llama"), tensor_parallel_size=2, **POOL)
    try:
        shards = llm.engine.runner.shards
        send = shards.send

        def send_then_interrupt(message):
            send(message)
            if type(message).__name__ == "Step":
                raise KeyboardInterrupt("Ctrl-C")

        shards.send = send_then_interrupt
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
        shards.send = send
        with pytest.raises(ShardError, match="out of step: rank 0's step ended early"):
            llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_a_rank_dead_before_the_group_forms_fails_the_start_at_once(model_factory):
    import torch

    from engine.models.arch import read_arch_config
    from engine.parallel.shard_client import launch_shards

    model_dir = model_factory("llama")
    config = EngineConfig(tensor_parallel_size=2, dtype="float32")
    client = launch_shards(model_dir, read_arch_config(model_dir), config,
                           torch.device("cpu"), torch.float32, 256)  # fmt: skip
    try:
        client.wait_hello()
        (pid,) = client.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ShardError, match="rank 1 exited with code -9"):
            # Rank 1 may reach the group's rendezvous between its hello and the kill (a
            # loaded machine slows this process, not it): then forming the group succeeds,
            # and the next wait of the start sees the death instead.
            client.join_group()
            client.wait_loaded()
        assert time.monotonic() - start < 5  # not the group's 300 s timeout
    finally:
        client.close()


def test_a_rank_outlives_no_parent_even_while_starting(model_factory):
    """Rank 0 killed while its shard still loads: the shard exits by itself."""
    script = (
        "import time\nfrom engine import LLM\n"
        f"LLM({str(model_factory('llama'))!r}, tensor_parallel_size=2, dtype='float32')\n"
        "time.sleep(600)\n"
    )
    # Its own temporary directory: a TP client that another test process starts meanwhile
    # sweeps dead owners' directories in the shared one (this one's, once it is killed).
    # (a short path: the shard's ZMQ ipc socket paths must fit in 107 bytes)
    own_tmp = Path(tempfile.mkdtemp())
    try:
        _kill_a_starting_parent(script, own_tmp)
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)


def _kill_a_starting_parent(script: str, own_tmp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(own_tmp)}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 60
        shard = None
        while shard is None and time.monotonic() < deadline:
            found = [pid for pid in _children_of(parent.pid)]
            shard = found[0] if found else None
            time.sleep(0.01)
        assert shard is not None, "the shard never started"
    finally:
        parent.kill()
        parent.wait()
    assert eventually(lambda: not is_running(shard), 10)
    # Its socket directory, which a killed process cannot remove, goes with the next client.
    left = list(own_tmp.glob(f"pdserve-tp-{socket.gethostname()}-{parent.pid}-*"))
    assert len(left) == 1, left
    assert left[0] in remove_dead_owners(own_tmp, "pdserve-tp-")


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(model_factory):
    children_before = _children()
    with pytest.raises(ModelLoadError, match="4 attention heads do not split over 3"):
        LLM(model_factory("llama"), tensor_parallel_size=3, **POOL)
    assert _children() == children_before


def _children() -> set[int]:
    return _children_of(os.getpid())


def _children_of(parent: int) -> set[int]:
    me = str(parent)
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                found.add(int(entry))
    return found


def test_a_rank_that_fails_to_start_is_reported_at_once(model_factory, tmp_path):
    """A shard that cannot load its weights says why; rank 0 raises that at its next wait
    (not at a timeout), and closing leaves no process behind."""
    from common.engine_config import EngineConfig
    from engine.models.arch import read_arch_config
    from engine.parallel.shard_client import launch_shards

    model_dir = model_factory("llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())  # no weights
    config = EngineConfig(tensor_parallel_size=2, dtype="float32")
    client = launch_shards(broken, read_arch_config(model_dir), config,
                           torch.device("cpu"), torch.float32, 256)  # fmt: skip
    group = None
    try:
        client.wait_hello()
        group = client.join_group()
        start = time.monotonic()
        with pytest.raises(ShardError, match="rank 1 failed: ModelLoadError.*no model.safetensors"):
            client.wait_loaded()
        assert time.monotonic() - start < 30
        (pid,) = client.pids
    finally:
        client.close()
        if group is not None:
            group.close()
    assert not is_running(pid)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_on_two_gpus_with_nccl_and_decode_graphs(model_factory):
    """NCCL collectives, the triton backend, and decode CUDA graphs captured around the
    all-reduce on every rank: the same tokens as one GPU (GPU_RUNBOOK.md step 8)."""
    model_dir = model_factory("llama")
    prompts = random_prompts((5, 33, 71))
    gpu = dict(dtype="float32", device="cuda", attention_backend="triton", max_model_len=512)
    expected = _tokens(LLM(model_dir, **gpu).generate(prompts, GREEDY, use_tqdm=False))
    with LLM(model_dir, tensor_parallel_size=2, **gpu) as llm:
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        graphs = llm.engine.runner.decode_graphs
        assert graphs is not None and graphs.num_replays > 0
        assert llm.engine.leak_report() == []


def test_a_workers_threads_are_shared_over_its_ranks(model_factory, monkeypatch):
    """A worker given 4 threads (``OMP_NUM_THREADS``: ``pdserve up``'s share, a pod's
    requested CPUs) splits into two ranks of 2: this one keeps 2, the shard is told 2;
    without the variable, the process's threads are split."""
    from engine.models.arch import read_arch_config
    from engine.parallel import shard_client

    launched = {}

    class Recorded:  # the shards' client, recording what they would be launched with
        def __init__(self, size, launch, *args) -> None:
            launched.update(launch)

    monkeypatch.setattr(shard_client, "ShardClient", Recorded)
    model_dir = model_factory("llama")
    threads = torch.get_num_threads()

    def launch() -> None:
        shard_client.launch_shards(model_dir, read_arch_config(model_dir),
                                   EngineConfig(tensor_parallel_size=2, dtype="float32"),
                                   torch.device("cpu"), torch.float32, 256)  # fmt: skip

    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        for _ in range(2):  # a second engine in the process divides the same 4
            launch()
            assert launched["num_threads"] == 2  # (the client takes it for this rank too)
        monkeypatch.delenv("OMP_NUM_THREADS")  # unset: this process's threads now
        torch.set_num_threads(6)
        launch()
        assert launched["num_threads"] == 3
    finally:
        torch.set_num_threads(threads)
