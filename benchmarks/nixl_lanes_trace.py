"""Do a NIXL fetch's read lanes copy at the same time? A diagnostic for the CPU path.

    python benchmarks/nixl_lanes_trace.py                      # 16 MB, scattered, defaults
    python benchmarks/nixl_lanes_trace.py --no-pin             # lanes left to the scheduler
    python benchmarks/nixl_lanes_trace.py --torch-copy         # a parallel torch copy before
                                                               # each fetch (OpenMP spin)

An exporter process (the one ``benchmarks/kv_transfer.py`` uses) exports blocks and this
process fetches them, one fetch at a time, over the connector's read lanes. Each lane's
READ is timed from inside the lane thread (the NIXL ``transfer`` call, where ``cma``
copies), so the script can tell, per fetch, whether the parts were copied side by side or
one after the other. It prints the median GB/s, how many fetches overlapped, and each lane
thread's time spent runnable but not running (``/proc/.../schedstat``). It reaches into
the connector's private lane objects: it is a measuring tool, not an API user.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import kv_transfer as bench  # noqa: E402
from engine.host_memory import zeros_for_kv_caches  # noqa: E402
from kv_transfer import KVTransferConfig, PeerRef, create_connector  # noqa: E402

MB = 1 << 20


def run_queue_wait_ms(thread_ids: list[int]) -> list[float]:
    """Per thread: ms spent runnable but waiting for a core (schedstat's second field)."""
    return [
        int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1]) / 1e6
        for tid in thread_ids
    ]


def instrument(lanes: list, spans: list[tuple[int, float, float]]) -> None:
    """Record (lane index, start, end) of every READ a lane posts."""
    for index, lane in enumerate(lanes):
        post = lane._agent.transfer

        def timed(handle, *args, _post=post, _index=index, **kwargs):
            start = time.perf_counter()
            state = _post(handle, *args, **kwargs)
            spans.append((_index, start, time.perf_counter()))
            return state

        lane._agent.transfer = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=16)
    parser.add_argument("--order", choices=["random", "contiguous"], default="random")
    parser.add_argument("--fetches", type=int, default=40)
    parser.add_argument("--lanes", type=int, default=0, help="0: the connector's default")
    parser.add_argument("--min-part-mb", type=float, default=2.0)
    parser.add_argument("--no-pin", action="store_true", help="leave lanes unpinned")
    parser.add_argument(
        "--torch-copy", action="store_true", help="a 64 MB torch copy_ before each fetch"
    )
    parser.add_argument("--gap-ms", type=float, default=0.0, help="idle time before a fetch")
    args = parser.parse_args()

    role_args = argparse.Namespace(device="cpu", num_blocks=640, nixl_progress_thread=False)
    exporter = bench.Role(role_args, "exporter", "nixl", "/tmp")
    metadata = exporter.call("metadata")
    engine_id = f"bench-exporter-{metadata['pid']}"
    known = {"exporter": bytes.fromhex(metadata["metadata"])}
    layout = bench.LAYOUT
    shape = (640, 2, layout["block_size"], layout["num_kv_heads"], layout["head_dim"])
    kv_caches = zeros_for_kv_caches(layout["num_layers"], shape, bench.DTYPE, torch.device("cpu"))
    config = KVTransferConfig(
        timeout_s=60,
        nixl_read_lanes=args.lanes,
        nixl_lane_min_bytes=int(args.min_part_mb * MB),
        nixl_pin_lanes=not args.no_pin,
    )
    connector = create_connector(config, f"trace-fetcher-{os.getpid()}", known.__getitem__)
    connector.register_kv_caches(kv_caches)
    lanes = connector._lanes
    spans: list[tuple[int, float, float]] = []
    instrument(lanes, spans)
    lane_tids = [lane._thread.native_id for lane in lanes]
    # Between fetches: evict the caches with one numpy thread, or a parallel torch copy.
    half = bench.EVICT_BYTES // 2  # the same eviction as the benchmark's
    evict = (np.ones(half, np.uint8), np.zeros(half, np.uint8))
    torch_pair = (torch.ones(64 * MB, dtype=torch.uint8), torch.zeros(64 * MB, dtype=torch.uint8))

    rng = random.Random(0)
    num_blocks = args.size_mb * MB // bench.block_bytes()
    nbytes = num_blocks * bench.block_bytes()
    seconds, overlapped, skews = [], 0, []
    warmup = 3
    wait_before = None
    try:
        for rep in range(warmup + args.fetches):
            remote = bench.pick_blocks(rng, args.order, num_blocks, 640)
            local = bench.pick_blocks(rng, args.order, num_blocks, 640)
            hashes = [os.urandom(32).hex() for _ in remote]
            exporter.call("export", tid=str(rep), block_ids=remote, hashes=hashes)
            if args.torch_copy:
                torch_pair[1].copy_(torch_pair[0])
            else:
                np.copyto(evict[1], evict[0])
            time.sleep(args.gap_ms / 1e3)
            if rep == warmup:
                wait_before = run_queue_wait_ms(lane_tids)
            spans.clear()
            start = time.perf_counter()
            connector.start_fetch(str(rep), PeerRef(engine_id, "exporter"), remote, local)
            connector.wait(str(rep), timeout_s=60)
            elapsed = time.perf_counter() - start
            if rep < warmup:
                continue
            seconds.append(elapsed)
            if len(spans) > 1:
                starts, ends = [s[1] for s in spans], [s[2] for s in spans]
                overlapped += max(starts) < min(ends)
                skews.append((max(starts) - min(starts)) * 1e3)
        wait_after = run_queue_wait_ms(lane_tids)
    finally:
        connector.close()
        exporter.close()

    print(
        f"{args.size_mb} MB {args.order}, {len(lanes)} lane(s), "
        f"{'unpinned' if args.no_pin else 'pinned'}"
        f"{', torch copy before each fetch' if args.torch_copy else ''}"
    )
    print(f"  median {nbytes / statistics.median(seconds) / 1e9:.2f} GB/s over {len(seconds)}")
    if skews:
        print(
            f"  parts copied side by side in {overlapped} of {len(seconds)} fetches; "
            f"median start skew {statistics.median(skews):.2f} ms"
        )
    for tid, before, after in zip(lane_tids, wait_before or [], wait_after, strict=False):
        per_fetch = (after - before) / len(seconds)
        print(f"  lane thread {tid}: {per_fetch:.3f} ms runnable-but-waiting per fetch")
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        print(f"  threads still alive: {names}")


if __name__ == "__main__":
    main()
