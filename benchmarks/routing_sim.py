"""Replay Mooncake traces through the router's own prefix index and placement policy.

    python -m benchmarks.routing_sim [--workers 8] [--capacity-blocks 0] [--trace FILE ...]
    python -m benchmarks.routing_sim --hot-prefix 40 [--hot-requests 1500]

No model runs. Each simulated prefill worker has a block cache (LRU of a configurable
capacity; 0 = unbounded) and a FIFO queue that computes uncached prompt tokens at a fixed
rate. The router's real ``PrefixIndex`` learns the caches from synthetic KV events
(BlockStored / BlockRemoved, exactly what workers publish) and the real
``PlacementPolicy`` places each request. Compared side by side on the same trace:

* ideal: one unbounded cache holding everything (the reuse ceiling);
* pdserve: index + policy, the prefix's recent uses dividing its charge
  (``router/prefix_demand.py``), as the router places;
* pdserve_undivided: the same, every prefix charged in full (``prefix_reuse_window_s: 0``);
* round-robin and random placement over the same simulated workers.

``--hot-prefix N``: instead of the traces, Poisson arrivals of requests sharing one
N-block prefix (a long system prompt or document), each with its own 3 blocks after it.

Reported: prompt-token hit ratio (and its fraction of the ideal), load imbalance (busiest
worker's computed tokens over the mean, minus 1), and the decision latency (index match +
policy) p50/p99. Results go to benchmarks/results/routing_sim.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.loadgen.traces import MOONCAKE_BLOCK_TOKENS, traces_dir
from common.kv_events import BlockRemoved, BlockStored
from common.router_config import RouterConfig
from router.policy import PlacementPolicy, WorkerLoad
from router.prefix_demand import PrefixDemand
from router.prefix_index import PrefixIndex

TRACE_BLOCK = MOONCAKE_BLOCK_TOKENS  # tokens per Mooncake hash id
TRACES = traces_dir() / "mooncake"
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    hashes: tuple[bytes, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    requests = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            hashes = tuple(int(h).to_bytes(8, "little") for h in row["hash_ids"])
            requests.append(TraceRequest(row["timestamp"] / 1000, row["input_length"], hashes))
            if limit and len(requests) >= limit:
                break
    return requests


def hot_prefix_trace(prefix_blocks: int, num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """Requests sharing one ``prefix_blocks``-block prefix, each with 3 blocks of its own,
    a second apart on average (the rate is set by the workers' speed, as for traces)."""
    rng = random.Random(seed)
    prefix = tuple(i.to_bytes(8, "little") for i in range(1, prefix_blocks + 1))
    requests, now = [], 0.0
    for i in range(num_requests):
        now += rng.expovariate(1.0)
        own = tuple((10**9 + 3 * i + j).to_bytes(8, "little") for j in range(3))
        requests.append(TraceRequest(now, (prefix_blocks + 3) * TRACE_BLOCK, prefix + own))
    return requests


def hit_tokens(num_blocks: int, input_length: int) -> int:
    return min(num_blocks * TRACE_BLOCK, input_length)


@dataclass
class SimWorker:
    worker_id: str
    capacity: int  # blocks; 0 = unbounded
    rate: float  # prefill tokens per second
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    busy_until: float = 0.0
    computed_tokens: int = 0

    def leading_hits(self, hashes: tuple[bytes, ...]) -> int:
        run = 0
        for block in hashes:
            if block not in self.cache:
                break
            run += 1
        return run

    def serve(self, request: TraceRequest, now: float) -> tuple[int, float, list, list]:
        """Compute the request; returns (hit blocks, TTFT, stored and evicted hashes)."""
        hits = self.leading_hits(request.hashes)
        uncached = request.input_length - hit_tokens(hits, request.input_length)
        self.busy_until = max(self.busy_until, now) + uncached / self.rate
        ttft = self.busy_until - now
        self.computed_tokens += uncached
        stored, evicted = [], []
        for block in request.hashes:
            if block in self.cache:
                self.cache.move_to_end(block)
            else:
                self.cache[block] = None
                stored.append(block)
        while self.capacity and len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        return hits, ttft, stored, evicted

    def load(self, now: float) -> WorkerLoad:
        queued = max(self.busy_until - now, 0.0) * self.rate
        return WorkerLoad(self.worker_id, int(queued), self.rate)


def ideal_hits(trace: list[TraceRequest]) -> int:
    seen: set[bytes] = set()
    total = 0
    for request in trace:
        run = 0
        for block in request.hashes:
            if block not in seen:
                break
            run += 1
        total += hit_tokens(run, request.input_length)
        seen.update(request.hashes)
    return total


Chooser = Callable[[TraceRequest, float, list[SimWorker]], SimWorker]


def simulate(trace, workers: list[SimWorker], choose: Chooser, index: PrefixIndex | None):
    hits = 0
    ttfts = []
    for request in trace:
        worker = choose(request, request.arrival_s, workers)
        num_hits, ttft, stored, evicted = worker.serve(request, request.arrival_s)
        hits += hit_tokens(num_hits, request.input_length)
        ttfts.append(ttft)
        if index is not None:  # what the worker's KV events tell the router
            events = []
            if stored:
                events.append(BlockStored(stored, None, [], TRACE_BLOCK))
            if evicted:
                events.append(BlockRemoved(evicted))
            index.apply(worker.worker_id, events)
    computed = [w.computed_tokens for w in workers]
    mean = statistics.mean(computed)
    ttfts.sort()
    ttft = {"mean": statistics.mean(ttfts), "p99": ttfts[int(len(ttfts) * 0.99)]}
    return hits, (max(computed) / mean - 1.0) if mean else 0.0, ttft


def pdserve_chooser(
    policy: PlacementPolicy, index: PrefixIndex, latencies: list[float], window_s: float
):
    decode = [WorkerLoad("decode-0", kv_blocks_total=1)]
    clock = [0.0]  # simulated time, for the prefixes' uses
    demand = PrefixDemand(window_s, clock=lambda: clock[0])

    def choose(request: TraceRequest, now: float, workers: list[SimWorker]) -> SimWorker:
        start = time.perf_counter_ns()
        clock[0] = now
        ids = [w.worker_id for w in workers]
        matches = index.match(request.hashes, ids)
        uses = demand.use_deepest(request.hashes, matches.values())
        placement = policy.place(
            request.input_length, decode, [w.load(now) for w in workers], {}, matches, None, uses
        )
        index.insert_optimistic(placement.prefill_worker, request.hashes)
        latencies.append((time.perf_counter_ns() - start) / 1000)
        return workers[ids.index(placement.prefill_worker)]

    return choose


def run_trace(path: Path | None, args: argparse.Namespace) -> dict:
    """One trace's results (``path`` None: the hot-prefix workload)."""
    if path is None:
        trace = hot_prefix_trace(args.hot_prefix, args.hot_requests)
    else:
        trace = load_trace(path, args.limit)
    duration = max(trace[-1].arrival_s, 1.0)
    ideal = ideal_hits(trace)
    total = sum(r.input_length for r in trace)
    # Per-worker speed giving the target utilization when every reusable token is reused.
    rate = (total - ideal) / duration / (args.workers * args.utilization)

    def fresh() -> list[SimWorker]:
        return [SimWorker(f"prefill-{i}", args.capacity_blocks, rate) for i in range(args.workers)]

    name = path.name if path is not None else f"hot prefix of {args.hot_prefix} blocks"
    results = {"trace": name, "requests": len(trace), "prompt_tokens": total,
               "ideal_hit_ratio": ideal / total}  # fmt: skip
    latencies: list[float] = []
    router_config = RouterConfig(
        min_disagg_tokens=0, prefill_recompute_penalty=args.recompute_penalty
    )
    policy = PlacementPolicy(router_config, TRACE_BLOCK, max_running=1)
    rng = random.Random(0)
    turn = iter(range(10**9))
    index = PrefixIndex(optimistic_ttl_s=1e9)  # simulated time never expires entries
    undivided = PrefixIndex(optimistic_ttl_s=1e9)
    window_s = router_config.prefix_reuse_window_s
    choosers: dict[str, tuple[Chooser, PrefixIndex | None]] = {
        "pdserve": (pdserve_chooser(policy, index, latencies, window_s), index),
        "pdserve_undivided": (pdserve_chooser(policy, undivided, [], 0.0), undivided),
        "round_robin": (lambda r, n, w: w[next(turn) % len(w)], None),
        "random": (lambda r, n, w: rng.choice(w), None),
    }
    for name, (choose, sim_index) in choosers.items():
        hits, imbalance, ttft = simulate(trace, fresh(), choose, sim_index)
        results[name] = {
            "hit_ratio": hits / total,
            "fraction_of_ideal": hits / ideal if ideal else 1.0,
            "load_imbalance": imbalance,
            "ttft_s": ttft,
        }
    latencies.sort()
    results["decision_us"] = {
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[int(len(latencies) * 0.99)],
        "max": latencies[-1],
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", nargs="*", type=Path,
                        default=sorted(TRACES.glob("*.jsonl")))  # fmt: skip
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--capacity-blocks", type=int, default=0, help="per worker; 0 = no limit")
    parser.add_argument("--utilization", type=float, default=0.7)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--recompute-penalty", type=float,
                        default=RouterConfig().prefill_recompute_penalty)  # fmt: skip
    parser.add_argument(
        "--hot-prefix",
        type=int,
        default=0,
        metavar="BLOCKS",
        help="simulate requests sharing one prefix of BLOCKS instead",
    )
    parser.add_argument("--hot-requests", type=int, default=1500)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    paths: list[Path | None] = [None] if args.hot_prefix else list(args.trace)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "workers": args.workers,
        "capacity_blocks": args.capacity_blocks,
        "utilization": args.utilization,
        "recompute_penalty": args.recompute_penalty,
        "traces": [run_trace(path, args) for path in paths],
    }
    for result in report["traces"]:
        print(f"\n{result['trace']}: {result['requests']} requests, ideal hit ratio "
              f"{result['ideal_hit_ratio']:.3f}")  # fmt: skip
        for name in ("pdserve", "pdserve_undivided", "round_robin", "random"):
            r = result[name]
            print(f"  {name:12s} hit {r['hit_ratio']:.3f}  ({r['fraction_of_ideal']:.3f} of "
                  f"ideal)  imbalance {r['load_imbalance']:+.1%}  TTFT mean "
                  f"{r['ttft_s']['mean']:.2f}s p99 {r['ttft_s']['p99']:.2f}s")  # fmt: skip
        d = result["decision_us"]
        print(f"  decision latency p50 {d['p50']:.1f} us, p99 {d['p99']:.1f} us")
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    (RESULTS / f"routing_sim{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
