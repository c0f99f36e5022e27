"""The prefix index and the placement policy, without processes."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
from types import SimpleNamespace

from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    StateRemoved,
    StateStored,
)
from common.router_config import RouterConfig
from router import prefix_index
from router.policy import PlacementPolicy, WorkerLoad
from router.prefix_index import PrefixIndex, PrefixMatch

H = [bytes([i]) * 32 for i in range(8)]


def stored(hashes, medium=Medium.GPU):
    return BlockStored(list(hashes), None, [0] * 16 * len(hashes), 16, medium)


def test_leading_runs_per_worker_and_tier():
    index = PrefixIndex()
    index.apply("a", [stored(H[:4])])
    index.apply("b", [stored(H[:2]), stored(H[2:3], Medium.CPU)])
    index.apply("c", [stored(H[1:4])])  # no first block: no usable prefix
    matches = index.match(H[:5], ["a", "b", "c", "d"])
    assert matches["a"] == PrefixMatch(4, 0)
    assert matches["b"] == PrefixMatch(2, 1)
    assert matches["c"] == PrefixMatch() == matches["d"]
    index.apply("a", [BlockRemoved([H[1]])])
    assert index.match(H[:5], ["a"])["a"] == PrefixMatch(1, 0)
    # A removal for the other tier does not remove the block.
    index.apply("b", [BlockRemoved([H[2]], Medium.GPU)])
    assert index.match(H[:5], ["b"])["b"] == PrefixMatch(2, 1)
    index.apply("b", [AllBlocksCleared()])
    assert index.num_blocks("b") == 0 and index.match(H, ["b"])["b"] == PrefixMatch()


def test_optimistic_entries_expire_unless_confirmed():
    index = PrefixIndex(optimistic_ttl_s=10)
    index.insert_optimistic("a", H[:3])
    assert index.match(H[:3], ["a"])["a"].gpu_blocks == 3
    index.apply("a", [stored(H[:1])])  # confirmed: no longer optimistic
    assert index.expire_optimistic(now=1e18) == 2
    assert index.match(H[:3], ["a"])["a"].gpu_blocks == 1


def test_optimistic_entries_are_withdrawn_when_the_blocks_went_elsewhere():
    index = PrefixIndex(optimistic_ttl_s=10)
    index.insert_optimistic("d0", H[:3])
    index.apply("d0", [stored(H[:1])])  # what events confirmed stays
    index.withdraw_optimistic("d0", H[:3])  # e.g. the first token ended the request
    assert index.match(H[:3], ["d0"])["d0"].gpu_blocks == 1
    assert index.expire_optimistic(now=1e18) == 0  # nothing optimistic was left


def test_a_removal_ends_an_optimistic_claim_and_confirmed_matches_ignore_claims():
    """A full cache hit re-claims the prompt (30 s); an eviction then must end the claim
    too, or the next request believes the blocks are there."""
    index = PrefixIndex(optimistic_ttl_s=10)
    index.apply("d0", [stored(H[:3])])
    index.insert_optimistic("d0", H[:4])
    assert index.match(H[:4], ["d0"])["d0"].gpu_blocks == 4
    assert index.match(H[:4], ["d0"], optimistic=False)["d0"].gpu_blocks == 3
    index.apply("d0", [BlockRemoved(H[:3])])
    assert index.match(H[:4], ["d0"])["d0"] == PrefixMatch()


def test_renewed_claims_expire_at_their_last_renewal_and_queue_once():
    """A hot prefix renewed by every request keeps one queue entry per claim (not one
    per renewal) and expires a TTL after its last renewal."""
    index = PrefixIndex(optimistic_ttl_s=10)
    for _ in range(100):
        index.insert_optimistic("d0", H[:4])
    assert len(index._expiries) == 4
    last = index._optimistic[H[1]]["d0"]  # the last renewal's expiry
    index._optimistic[H[0]]["d0"] = last + 5  # renewed once more, later
    assert index.expire_optimistic(now=last) == 3
    assert index.match(H[:1], ["d0"])["d0"].gpu_blocks == 1
    assert index.expire_optimistic(now=last + 5) == 1
    assert index.match(H[:1], ["d0"])["d0"] == PrefixMatch() and not index._expiries


def test_a_renewed_claim_expires_on_time_behind_later_claims(monkeypatch):
    """Claimed at 0 and renewed at 20 (expires at 50), then another claim at 29 (expires
    at 59): the first is gone at 50. A queue in insertion order put the renewal, found at
    the first expiry (30), behind the later claim, and the claim matched until 59."""
    index = PrefixIndex(optimistic_ttl_s=30)
    clock = [0.0]
    monkeypatch.setattr(prefix_index, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    index.insert_optimistic("d0", H[:1])
    clock[0] = 20.0
    index.insert_optimistic("d0", H[:1])  # renewed
    clock[0] = 29.0
    index.insert_optimistic("d1", H[1:2])
    assert index.expire_optimistic(now=30.0) == 0  # (its first expiry: renewed, kept)
    assert index.expire_optimistic(now=51.0) == 1
    assert index.match(H[:1], ["d0"])["d0"] == PrefixMatch()
    assert index.match(H[1:2], ["d1"])["d1"].gpu_blocks == 1


def oracle_match(held: dict[str, dict[bytes, str]], states: dict[str, set[bytes]], hashes,
                 worker_ids):  # fmt: skip
    """The leading run per worker, by brute force: ``held[w][h]`` is "gpu" or "cpu";
    ``states[w]`` the blocks a state snapshot follows on ``w``."""
    result = {}
    for worker_id in worker_ids:
        blocks, snapshots = held.get(worker_id, {}), states.get(worker_id, set())
        run = 0
        while run < len(hashes) and hashes[run] in blocks:
            run += 1
        on_cpu = sum(blocks[h] == "cpu" for h in hashes[:run])
        resumable = max((i + 1 for i in range(run) if hashes[i] in snapshots), default=0)
        result[worker_id] = PrefixMatch(run - on_cpu, on_cpu, resumable)
    return result


def test_random_events_match_a_brute_force_oracle_across_many_workers():
    """70 workers (more bits than a machine word), random stores, removals in both tiers,
    state snapshots coming and going, workers leaving (their bits swept off a few blocks
    at a time, between the other events) and new ones taking the freed bits."""
    rng = random.Random(7)
    hashes = [i.to_bytes(8, "little") for i in range(40)]
    index, held, states = PrefixIndex(), {}, {}
    workers = [f"w{i}" for i in range(70)]
    for step in range(3000):
        worker_id = rng.choice(workers)
        blocks = held.setdefault(worker_id, {})
        snapshots = states.setdefault(worker_id, set())
        action = rng.random()
        if action < 0.1:  # (after any block, held or not: the engine's may outlive it)
            follows = rng.sample(hashes, rng.randrange(1, 4))
            fresh = [h for h in follows if h not in snapshots]  # announced once each
            index.apply(worker_id, [StateStored(fresh)])
            snapshots.update(fresh)
        elif action < 0.15 and snapshots:
            gone = rng.sample(sorted(snapshots), min(len(snapshots), rng.randrange(1, 3)))
            index.apply(worker_id, [StateRemoved(gone)])
            snapshots.difference_update(gone)
        elif action < 0.5:
            start = rng.randrange(40)
            run = hashes[start : start + rng.randrange(1, 8)]
            medium = rng.choice([Medium.GPU, Medium.CPU])
            tier = "cpu" if medium is Medium.CPU else "gpu"
            run = [h for h in run if blocks.get(h, tier) == tier]  # one tier per block
            index.apply(worker_id, [stored(run, medium)])
            blocks.update(dict.fromkeys(run, tier))
        elif action < 0.9 and blocks:
            gone = rng.sample(sorted(blocks), min(len(blocks), rng.randrange(1, 4)))
            for h in gone:
                medium = Medium.CPU if blocks[h] == "cpu" else Medium.GPU
                index.apply(worker_id, [BlockRemoved([h], medium)])
                del blocks[h]
        elif action < 0.95:
            index.clear_worker(worker_id)
            held.pop(worker_id)
            states.pop(worker_id)
            workers.remove(worker_id)
            workers.append(f"w{70 + step}")  # a newcomer reuses a freed bit
        if rng.random() < 0.3:
            index.sweep(rng.randrange(1, 6))
        if step % 50 == 0:
            asked = rng.sample(workers, 12) + ["never-seen"]
            query = hashes[: rng.randrange(1, 40)]
            assert index.match(query, asked) == oracle_match(held, states, query, asked)
    for worker_id in workers:
        assert index.num_blocks(worker_id) == len(held.get(worker_id, {}))
    while index.sweeping:
        index.sweep()
    in_use = 0
    for bit in index._bits.values():
        in_use |= bit
    for tier in (index._gpu, index._cpu, index._states):  # no cleared worker's bit left
        assert all(mask and not mask & ~in_use for mask in tier.values())
    # The big maps hold only bytes and ints: nothing for the cycle collector to traverse.
    assert not any(gc.is_tracked(tier) for tier in (index._gpu, index._cpu, index._states))


def test_a_cleared_workers_blocks_are_swept_a_slice_at_a_time():
    """Clearing a worker took its bit off every block at once, under the lock every
    placement waits for (226 ms at 300k blocks): now it only forgets the worker, which no
    match sees at once, and ``sweep`` takes the bit off a bounded slice per call; the bit
    is reused only after that."""
    many = [i.to_bytes(8, "little") for i in range(10_000)]
    index = PrefixIndex()
    index.apply("a", [stored(many)])
    index.apply("b", [stored(many[:10])])
    index.clear_worker("a")
    assert index.match(many[:10], ["a", "b"]) == {"a": PrefixMatch(), "b": PrefixMatch(10, 0)}
    assert len(index._gpu) == 10_000 and index.sweeping  # untouched yet
    index.apply("c", [stored(many[:3])])  # a newcomer while "a"'s bit is still out there
    assert index._bits["c"] not in (index._bits["b"], 1)  # ("a" had bit 1)
    assert index.match(many[:10], ["c"])["c"] == PrefixMatch(3, 0)
    index.sweep(4096)
    assert 10_000 - len(index._gpu) == 4096 - 10  # ("b" and "c" still hold the first 10)
    while index.sweeping:
        index.sweep(4096)
    assert len(index._gpu) == 10 and index._free_bits == [1]
    index.apply("d", [stored(many[:1])])
    assert index._bits["d"] == 1


def test_policy_prefers_cache_then_load_and_keeps_short_prompts_local():
    policy = PlacementPolicy(RouterConfig(min_disagg_tokens=100), block_size=16, max_running=8)
    decode = [WorkerLoad("d0", num_running=1, kv_blocks_total=100),
              WorkerLoad("d1", num_running=0, kv_blocks_total=100)]  # fmt: skip
    prefill = [WorkerLoad("p0", queued_prefill_tokens=0),
               WorkerLoad("p1", queued_prefill_tokens=0)]  # fmt: skip
    # 800 tokens; p1 caches 30 blocks (480 tokens): cheaper TTFT there.
    place = policy.place(800, decode, prefill, {}, {"p1": PrefixMatch(30, 0)})
    assert place.prefill_worker == "p1" and place.decode_worker == "d1"
    assert place.prefill_cached_tokens == 480
    # A long queue on p1 outweighs its cache.
    busy = [WorkerLoad("p0"), WorkerLoad("p1", queued_prefill_tokens=50_000)]
    assert policy.place(800, decode, busy, {}, {"p1": PrefixMatch(30, 0)}).prefill_worker == "p0"
    # Short prompt, or mostly cached on the decode worker: prefill locally.
    assert policy.place(50, decode, prefill, {}, {}).prefill_worker is None
    local = policy.place(800, decode, prefill, {"d0": PrefixMatch(45, 0)}, {})
    assert local.decode_worker == "d0" and not local.disaggregated
    # Blocks only claimed (the first request of a burst, still prefilling elsewhere)
    # steer the choice of decode worker but do not make it prefill the prompt itself.
    claimed = policy.place(800, decode, prefill, {"d0": PrefixMatch(45, 0)}, {}, {})
    assert claimed.decode_worker == "d0" and claimed.disaggregated
    assert claimed.decode_cached_tokens == 0
    # A CPU hit counts at its credit when workers are ranked...
    cpu = policy.cached_tokens(PrefixMatch(0, 10), 800)
    assert cpu == 0.5 * 160
    # ...but a prompt the decode worker holds whole in its CPU tier is loaded there, not
    # recomputed on a prefill worker (the credit halved it: 512 of 1025 tokens "held").
    tiered = policy.place(1025, decode, prefill, {"d0": PrefixMatch(0, 64)}, {})
    assert tiered.decode_worker == "d0" and not tiered.disaggregated
    assert tiered.decode_cached_tokens == 1024


def test_a_hybrid_decode_worker_prefills_locally_only_what_it_can_resume():
    """A hybrid model's decode worker holds a pulled prompt's KV but not the state
    snapshot at its end: an exact repeat (all 50 blocks held) goes to a prefill worker,
    which resumes it; a next turn whose first 49 blocks end at a snapshot there (a
    rolling one) is prefilled where it is."""
    policy = PlacementPolicy(RouterConfig(min_disagg_tokens=100), block_size=16,
                             max_running=8, hybrid=True)  # fmt: skip
    decode = [WorkerLoad("d0", kv_blocks_total=100), WorkerLoad("d1", kv_blocks_total=100)]
    prefill = [WorkerLoad("p0")]
    repeat = {"d0": PrefixMatch(50, 0, resumable_blocks=0)}
    placed = policy.place(801, decode, prefill, repeat, {}, repeat)
    assert placed.decode_worker == "d0" and placed.disaggregated  # (it pulls no KV block)
    assert placed.decode_cached_tokens == 0
    turn = {"d0": PrefixMatch(45, 5, resumable_blocks=49)}
    placed = policy.place(801, decode, prefill, turn, {}, turn)
    assert placed.decode_worker == "d0" and not placed.disaggregated
    assert placed.decode_cached_tokens == 49 * 16
    # A dense model's worker resumes from any block: the repeat stays local.
    dense = PlacementPolicy(RouterConfig(min_disagg_tokens=100), block_size=16, max_running=8)
    assert not dense.place(801, decode, prefill, repeat, {}, repeat).disaggregated


def test_a_prefix_many_requests_share_is_spread_over_idle_workers():
    """A 640-token prefix held by p0 (a queue of 2,000 tokens) and d0 (20 of 64 running):
    a conversation's next turn (its one use) stays with them; a prefix 50 recent requests
    used goes where the work is least (the full charge herded a routing simulation's
    hot-prefix requests onto 2 of 4 prefill workers: TTFT p50 5.7 s against 0.16 s)."""
    policy = PlacementPolicy(RouterConfig(min_disagg_tokens=0), block_size=16, max_running=64)
    decode = [WorkerLoad("d0", num_running=20, kv_blocks_total=1000),
              WorkerLoad("d1", num_running=0, kv_blocks_total=1000)]  # fmt: skip
    prefill = [WorkerLoad("p0", queued_prefill_tokens=2000), WorkerLoad("p1")]
    held = {"d0": PrefixMatch(40, 0), "p0": PrefixMatch(40, 0)}
    turn = policy.place(800, decode, prefill, held, held, {}, uses=1.0)
    assert (turn.decode_worker, turn.prefill_worker) == ("d0", "p0")
    shared = policy.place(800, decode, prefill, held, held, {}, uses=50.0)
    assert (shared.decode_worker, shared.prefill_worker) == ("d1", "p1")
    # Its recomputation is spread over its uses as well, not only the penalty: p0 ahead
    # by less than the prefix (400 tokens) still moves a hot prefix's request, which
    # then serves the next ones there; a single use still stays.
    ahead = [WorkerLoad("p0", queued_prefill_tokens=400), WorkerLoad("p1")]
    assert policy.place(800, decode, ahead, held, held, {}, uses=50.0).prefill_worker == "p1"
    assert policy.place(800, decode, ahead, held, held, {}, uses=1.0).prefill_worker == "p0"


def test_a_prefill_worker_without_room_for_the_prompt_is_passed_over():
    """Its pool full of leased blocks (a decode worker frozen mid-hand-off), p0 looked
    idle, and its request waited for a lease to expire (19 s at lease_s 20) beside an
    idle p1. Where no worker has the room, or its room is not known, the cost decides."""
    policy = PlacementPolicy(RouterConfig(min_disagg_tokens=0), block_size=16, max_running=64)
    decode = [WorkerLoad("d0", kv_blocks_total=1000)]
    held = {"p0": PrefixMatch(10, 0)}  # p0 caches 10 of the prompt's 50 blocks
    full = [WorkerLoad("p0", kv_blocks_free=26), WorkerLoad("p1", kv_blocks_free=64)]
    assert policy.place(800, decode, full, {}, held).prefill_worker == "p1"
    # 40 more blocks fit p0 once it has 40 free, less what is queued there.
    fits = [WorkerLoad("p0", kv_blocks_free=40), WorkerLoad("p1", kv_blocks_free=64)]
    assert policy.place(800, decode, fits, {}, held).prefill_worker == "p0"
    queued = [WorkerLoad("p0", queued_prefill_tokens=16, kv_blocks_free=40),
              WorkerLoad("p1", kv_blocks_free=64)]  # fmt: skip
    assert policy.place(800, decode, queued, {}, held).prefill_worker == "p1"
    neither = [WorkerLoad("p0", kv_blocks_free=5), WorkerLoad("p1", kv_blocks_free=5)]
    unknown = [WorkerLoad("p0"), WorkerLoad("p1", kv_blocks_free=64)]
    for loads in (neither, unknown):
        assert policy.place(800, decode, loads, {}, held).prefill_worker == "p0"


def test_ties_rotate_over_every_worker_of_each_role():
    policy = PlacementPolicy(RouterConfig(), block_size=16, max_running=64)
    decode = [WorkerLoad("d0", kv_blocks_total=1000), WorkerLoad("d1", kv_blocks_total=1000)]
    prefill = [WorkerLoad("p0"), WorkerLoad("p1")]
    places = [policy.place(1000, decode, prefill, {}, {}) for _ in range(4)]
    assert all(place.disaggregated for place in places)
    assert {place.decode_worker for place in places} == {"d0", "d1"}
    assert {place.prefill_worker for place in places} == {"p0", "p1"}


def test_router_starts_without_torch():
    code = "import sys, router.app, router.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
