"""The prefix index and the placement policy, without processes."""

from __future__ import annotations

import subprocess
import sys

from common.config import RouterConfig
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Medium
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


def test_policy_prefers_cache_then_load_and_keeps_short_prompts_local():
    policy = PlacementPolicy(RouterConfig(min_disagg_tokens=100), block_size=16, max_running=8)
    decode = [WorkerLoad("d0", running=1, kv_blocks_total=100),
              WorkerLoad("d1", running=0, kv_blocks_total=100)]  # fmt: skip
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
    # A CPU hit counts at its credit.
    cpu = policy.cached_tokens(PrefixMatch(0, 10), 800)
    assert cpu == 0.5 * 160


def test_router_starts_without_torch():
    code = "import sys, router.app, router.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
