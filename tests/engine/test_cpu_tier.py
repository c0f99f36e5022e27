"""The CPU offload tier on a real tiny model: evicted prefixes come back from CPU memory,
outputs stay identical, events follow both tiers, nothing leaks under churn and aborts."""

from __future__ import annotations

import random

import pytest

from common.engine_config import EngineConfig
from common.hashing import hash_blocks
from common.kv_events import BlockRemoved, BlockStored, Medium
from engine import LLMEngine, SamplingParams
from engine.kv_events import KVEventCollector
from router.prefix_index import PrefixIndex
from tests.engine.helpers import random_prompts

GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
SMALL_POOL = dict(num_blocks=24, max_model_len=256)  # 384 tokens of device KV


def run(engine: LLMEngine, prompts: list[list[int]], prefix: str = "r") -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_evicted_prefix_is_served_from_the_cpu_tier(tiny_llama, kv_cache_dtype):
    """With an FP8 cache too: the tier keeps its bytes (torch has no CPU index_copy_ for
    FP8, so they move as bytes)."""
    prefix = random_prompts((160,), seed=91)[0]  # 10 full blocks
    fillers = random_prompts((200, 200, 200), seed=92)
    question = prefix + [7, 8, 9]
    results = {}
    for tier_bytes in (0, 64 << 20):
        config = EngineConfig(
            cpu_offload_bytes=tier_bytes, kv_cache_dtype=kv_cache_dtype, **SMALL_POOL
        )
        engine = LLMEngine(tiny_llama, config)
        run(engine, [prefix + [1, 2, 3]], "warm")
        run(engine, fillers, "fill")  # pushes the prefix out of the device pool
        assert engine.scheduler.kv.get_computed_blocks(_probe(engine, question))[1] == 0, (
            "the prefix should have left the device pool"
        )
        before = engine.num_prompt_tokens_computed
        (out,) = run(engine, [question], "q")
        results[tier_bytes] = (out, engine.num_prompt_tokens_computed - before)
        assert engine.leak_report() == []
        if tier_bytes:
            assert engine.cpu_tier.stats.hit_blocks == 10
    (plain, plain_work), (tiered, tiered_work) = results[0], results[64 << 20]
    assert plain.num_cached_tokens == 0 and tiered.num_cached_tokens == 160
    assert plain_work == len(question) and tiered_work == len(question) - 160
    assert tiered.outputs[0].token_ids == plain.outputs[0].token_ids


def _probe(engine: LLMEngine, tokens: list[int]):
    from engine.request import Request

    request = Request("probe", tokens, GREEDY, frozenset(), 256)
    engine.scheduler.kv.update_block_hashes(request)
    return request


def test_cpu_events_follow_the_tier_and_the_router_index_follows_them(tiny_llama):
    collector = KVEventCollector()
    block_bytes = 4 * 2 * 16 * 2 * 64 * 4  # layers * K/V * block * heads * dim * fp32
    engine = LLMEngine(
        tiny_llama,
        EngineConfig(cpu_offload_bytes=12 * block_bytes, **SMALL_POOL),
        kv_events=collector,
    )
    index = PrefixIndex()
    prompts = random_prompts((160, 200, 200, 200, 200), seed=93)
    first_hashes = hash_blocks(prompts[0], 16)
    run(engine, prompts[:1], "a")
    index.apply("w", collector.drain())
    assert index.match(first_hashes, ["w"])["w"].gpu_blocks == 10
    run(engine, prompts[1:3], "b")  # evicts the first prompt to the CPU tier
    events = collector.drain()
    index.apply("w", events)
    cpu_stored = {h for e in events if isinstance(e, BlockStored) and e.medium is Medium.CPU
                  for h in e.block_hashes}  # fmt: skip
    assert set(first_hashes) & cpu_stored
    match = index.match(first_hashes, ["w"])["w"]
    assert match.cpu_blocks > 0
    run(engine, prompts[3:], "c")  # the 12-block CPU tier overflows: its LRU blocks go
    events = collector.drain()
    cpu_removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium is Medium.CPU
                   for h in e.block_hashes]  # fmt: skip
    assert set(first_hashes) & set(cpu_removed)
    index.apply("w", events)
    assert index.match(first_hashes, ["w"])["w"].num_blocks < match.num_blocks
    assert engine.leak_report() == []


def test_churn_with_aborts_leaks_nothing_and_keeps_outputs(tiny_llama):
    rng = random.Random(94)
    stems = random_prompts((48, 80, 112), seed=95)
    prompts = [rng.choice(stems) + [rng.randrange(5, 2000) for _ in range(rng.randrange(1, 40))]
               for _ in range(30)]  # fmt: skip
    reference = LLMEngine(tiny_llama, EngineConfig(max_model_len=256))
    expected = [o.outputs[0].token_ids for o in run(reference, prompts, "ref")]
    block_bytes = 4 * 2 * 16 * 2 * 64 * 4
    engine = LLMEngine(
        tiny_llama,
        EngineConfig(cpu_offload_bytes=20 * block_bytes, max_num_seqs=6, **SMALL_POOL),
    )
    aborted = set()
    done = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        step += 1
        if step % 5 == 0:  # abort a random unfinished request now and then
            live = sorted(engine.scheduler.requests)
            if live:
                victim = rng.choice(live)
                engine.abort_request(victim)
                aborted.add(victim)
    tier = engine.cpu_tier
    assert tier.stats.offloaded_blocks > 0 and tier.stats.hit_blocks > 0
    assert tier.stats.evicted_blocks > 0
    for i in range(len(prompts)):
        if f"r{i}" not in aborted:
            assert done[f"r{i}"].outputs[0].token_ids == expected[i]
    assert engine.leak_report() == []
    assert reference.leak_report() == []


def test_snapshot_blocks_are_kept_unannounced_and_come_back_bit_for_bit():
    """A hybrid model's snapshot blocks (``on_state_block_evicted``) are kept like KV
    blocks, under their names, but no event names them, entering or leaving."""
    import torch

    from engine.block_pool import KVBlock
    from engine.cpu_tier import CpuTier

    cache = torch.randn(8, 2, 4, 1, 2)  # [num_blocks, K/V, block_size, heads, head_dim]
    source = cache.clone()
    events = []
    tier = CpuTier([cache], capacity_bytes=3 * cache[0].numel() * 4, emit=events.append)
    kv_hash, names = b"k" * 32, [b"s0" * 16, b"s1" * 16]
    tier.on_block_evicted(KVBlock(0), kv_hash)
    tier.on_state_block_evicted(KVBlock(1), names[0])
    tier.on_state_block_evicted(KVBlock(2), names[1])
    tier.flush()
    assert [(type(e), e.block_hashes) for e in events] == [(BlockStored, [kv_hash])]
    assert tier.lookup(names) == 2
    tier.reserve(names)
    cache[5:7] = 0
    tier.load(names, [5, 6])
    assert torch.equal(cache[5:7], source[1:3])
    # Full: the two least recently used go, the KV block (announced) and then a
    # snapshot's (silently: its last, the first block of a run being the most recently
    # used); the snapshot that came in is not announced either.
    tier.on_block_evicted(KVBlock(3), b"x" * 32)
    tier.on_state_block_evicted(KVBlock(4), b"y" * 32)
    tier.flush()
    assert [(type(e), e.block_hashes) for e in events[1:]] == [
        (BlockRemoved, [kv_hash]),
        (BlockStored, [b"x" * 32]),
    ]
    assert tier.lookup(names) == 1 and tier.lookup(names[1:]) == 0
    assert tier.leak_report() == []


def test_a_spilled_prompt_loses_its_end_first():
    """The device evicts a prompt's end before its start, and a lookup needs the run from
    the start: the tier keeps the start longest, as blocks come in and as they are loaded
    (the newest eviction made least recent, a tier holding 9 of a prompt's blocks lost
    its first and found 1)."""
    import torch

    from engine.block_pool import KVBlock
    from engine.cpu_tier import CpuTier

    cache = torch.randn(16, 2, 4, 1, 2)
    tier = CpuTier([cache], capacity_bytes=6 * cache[0].numel() * 4, emit=lambda _: None)
    prompt = [bytes([i]) * 32 for i in range(6)]
    for block_id in reversed(range(6)):  # its end first, as the device evicts
        tier.on_block_evicted(KVBlock(block_id), prompt[block_id])
    tier.flush()
    assert tier.lookup(prompt) == 6
    tier.on_block_evicted(KVBlock(6), b"o" * 32)
    tier.on_block_evicted(KVBlock(7), b"p" * 32)
    tier.flush()  # full: two of the prompt's go, its last two
    assert tier.lookup(prompt) == 4
    tier.reserve(prompt[:4])
    tier.load(prompt[:4], [8, 9, 10, 11])  # used again: its start the most recent
    for i, other in enumerate((b"q", b"r", b"s", b"t")):
        tier.on_block_evicted(KVBlock(12 + i), other * 32)
        tier.flush()
    assert tier.lookup(prompt) == 2  # o, p, then the prompt's 4th and 3rd went
    assert tier.leak_report() == []


def test_a_block_evicted_twice_before_a_flush_takes_one_slot():
    """Two evictions of one hash between flushes took two slots and kept one: a leak."""
    import torch

    from engine.block_pool import KVBlock
    from engine.cpu_tier import CpuTier

    cache = torch.randn(8, 2, 4, 1, 2)
    tier = CpuTier([cache], capacity_bytes=4 * cache[0].numel() * 4, emit=lambda _: None)
    block_hash = b"h" * 32
    tier.on_block_evicted(KVBlock(3), block_hash)
    tier.on_block_evicted(KVBlock(5), block_hash)
    tier.flush()
    assert tier.num_used_blocks == 1 and tier.lookup([block_hash]) == 1
    assert tier.leak_report() == []
    tier.reserve([block_hash])
    tier.load([block_hash], [0])  # the last eviction's copy (block 5)
    assert torch.equal(cache[0], cache[5])
    assert tier.leak_report() == []


def test_a_prompt_spilled_again_over_its_held_start_keeps_its_start():
    """A turn's prefix the tier holds, spilled again with the turn (its end new): recency
    in eviction order over held and new blocks alike. Held ones were made recent first,
    then the new end after them, and the start went first (3 held, 0 found)."""
    import torch

    from engine.block_pool import KVBlock
    from engine.cpu_tier import CpuTier

    cache = torch.randn(32, 2, 4, 1, 2)
    tier = CpuTier([cache], capacity_bytes=6 * cache[0].numel() * 4, emit=lambda _: None)
    prompt = [bytes([i]) * 32 for i in range(6)]
    for block_id in reversed(range(3)):  # the first turn's 3 blocks
        tier.on_block_evicted(KVBlock(block_id), prompt[block_id])
    tier.flush()
    for block_id in reversed(range(6)):  # the next turn's 6, its first 3 held already
        tier.on_block_evicted(KVBlock(10 + block_id), prompt[block_id])
    tier.flush()
    assert [h[0] for h in tier._slots] == [5, 4, 3, 2, 1, 0]  # least recent first
    for i, other in enumerate((b"q", b"r", b"s")):
        tier.on_block_evicted(KVBlock(20 + i), other * 32)
        tier.flush()
    assert tier.lookup(prompt) == 3
    assert tier.leak_report() == []


def test_a_tier_of_no_block_or_past_the_hosts_memory_is_refused(monkeypatch):
    """Named by its key, before anything is allocated: a tier 4x the host's memory
    started (its memory is committed as blocks are saved) and would have got the worker
    killed under load."""
    import pytest
    import torch

    from common.config_base import ConfigError
    from engine import cpu_tier
    from engine.cpu_tier import CpuTier
    from engine.host_memory import host_memory_bytes

    cache = torch.zeros(4, 2, 4, 1, 2)
    with pytest.raises(ConfigError, match="hold no block of 64 bytes"):
        CpuTier([cache], capacity_bytes=10)
    memory = host_memory_bytes()
    assert memory is not None and memory > 2**28
    with pytest.raises(ConfigError, match="more than this host's memory") as error:
        CpuTier([cache], capacity_bytes=4 * memory)
    assert error.value.key.startswith("engine.cpu_offload_bytes")
    # Per rank: 3 tensor-parallel ranks on the host hold one each (a host of 1 MiB here).
    monkeypatch.setattr(cpu_tier, "host_memory_bytes", lambda: 2**20)
    CpuTier([cache], capacity_bytes=2**19)
    with pytest.raises(ConfigError, match="on each of 3 ranks"):
        CpuTier([cache], capacity_bytes=2**19, num_ranks=3)


def test_the_cgroup_limit_is_this_processs_cgroups(tmp_path):
    """The cgroup /proc/self/cgroup names, and those above it (the root's own files are
    another cgroup's unless a namespace made it this one's); "max" and v1's huge "no
    limit" are none."""
    from engine.host_memory import _cgroup_limits

    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "a" / "memory.max").write_text("1000\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (root / "memory" / "x").mkdir(parents=True)
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("2000\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    membership = tmp_path / "self_cgroup"
    membership.write_text("0::/a/b\n")
    assert _cgroup_limits(root, membership) == [1000]
    membership.write_text("4:memory:/x\n3:cpuset:/\n0::/\n")
    assert _cgroup_limits(root, membership) == [2000]
    assert _cgroup_limits(root, tmp_path / "missing") == []
