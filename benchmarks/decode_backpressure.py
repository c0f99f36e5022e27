"""Decode backpressure on and off (``router.decode_queue_factor``), on a decode-bound burst.

    python benchmarks/decode_backpressure.py [--scenario audit|kv-bound] [--out PATH]

One 1P1D stack per setting (prefill worker on core 0, decode worker on core 1; run one
after the other), with a small decode side: 64 KV blocks of 16 tokens. The burst (from an
overload audit): 30 long prompts (300 tokens, 16 output tokens; they go to the prefill
worker) at once, then 0.5 s later 150 short ones (40 tokens, 200 output tokens; below
``min_disagg_tokens``, so the decode worker prefills them itself). Without backpressure
the prefill worker leases its blocks to a decode worker that cannot pull them for tens of
seconds, and leases that expire make the decode worker recompute those prompts; with it,
sequences wait in the router in arrival order.

Scenarios: ``audit`` (``max_num_seqs`` 8: the limit in sequences binds) and ``kv-bound``
(``max_num_seqs`` 32: 2 x 32 sequences of up to 19 blocks would be far more than the 64
blocks the decode worker has, so only the limit in KV blocks binds, as with long-context
traffic on a GPU).

Prints per class and setting TTFT and end-to-end latency (p50, max), leases that expired
unpulled and pulls given up (recomputed), and the on/off ratios; writes ``<out>.md`` and
``<out>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.loadgen.bench import machine_info  # noqa: E402
from benchmarks.loadgen.pinned_stack import PinnedStack, Placement  # noqa: E402
from benchmarks.records import write_markdown  # noqa: E402

SETTINGS = {"off": 0.0, "on": 2.0}  # decode_queue_factor
ENGINE = {"num_blocks": 64, "max_model_len": 512}
SCENARIOS = {"audit": {"max_num_seqs": 8}, "kv-bound": {"max_num_seqs": 32}}  # engine
CLASSES = {"long": (30, 300, 16, 0.0), "short": (150, 40, 200, 0.5)}  # n, prompt, out, delay


async def one(client: httpx.AsyncClient, url: str, seed: int, prompt_len: int,
              max_tokens: int, delay_s: float) -> tuple[float, float]:  # fmt: skip
    """(TTFT, end-to-end) seconds of one streamed completion of random token ids."""
    await asyncio.sleep(delay_s)
    rng = random.Random(seed)
    body = {"prompt": [rng.randrange(3, 2000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/completions", json=body, timeout=900) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and ttft is None:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, time.perf_counter() - start


async def burst(url: str) -> dict[str, list[tuple[float, float]]]:
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(limits=limits) as client:
        jobs = {name: [one(client, url, seed * 1000 + i, plen, out, delay) for i in range(n)]
                for seed, (name, (n, plen, out, delay)) in enumerate(CLASSES.items())}  # fmt: skip
        results = await asyncio.gather(*(j for js in jobs.values() for j in js))
    by_class, index = {}, 0
    for name, js in jobs.items():
        by_class[name] = results[index : index + len(js)]
        index += len(js)
    return by_class


def run_setting(name: str, factor: float, model: Path, engine: dict[str, int]) -> dict[str, Any]:
    stack = PinnedStack(
        f"backpressure-{name}", model, [Placement("prefill", 0, 0), Placement("decode", 0, 1)],
        overrides={"engine": engine, "router": {"decode_queue_factor": factor,
                                                "min_disagg_tokens": 256}},
    )  # fmt: skip
    stack.start()
    try:
        stack.wait_ready()
        by_class = asyncio.run(burst(stack.base_url))
        prefill, decode = stack.worker_stats("prefill"), stack.worker_stats("decode")
    finally:
        stack.stop()
    record: dict[str, Any] = {"decode_queue_factor": factor,
                              "leases_expired": prefill.leases_expired,
                              "pulls_given_up": decode.transfer_failures}  # fmt: skip
    for cls, times in by_class.items():
        ttfts, e2es = [t for t, _ in times], [e for _, e in times]
        record[cls] = {"n": len(times), "ttft_p50_s": statistics.median(ttfts),
                       "ttft_max_s": max(ttfts), "e2e_p50_s": statistics.median(e2es),
                       "e2e_max_s": max(e2es)}  # fmt: skip
    print(f"  {name}: {json.dumps(record)}", flush=True)
    return record


def table(records: dict[str, dict[str, Any]]) -> str:
    off, on = records["off"], records["on"]
    lines = ["| class | metric | off | on | on / off |", "|---|---|---:|---:|---:|"]
    for cls in CLASSES:
        for key in ("ttft_p50_s", "ttft_max_s", "e2e_p50_s", "e2e_max_s"):
            a, b = off[cls][key], on[cls][key]
            lines.append(f"| {cls} | {key} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    for key in ("leases_expired", "pulls_given_up"):
        lines.append(f"| all | {key} | {off[key]} | {on[key]} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the demo model")
    p.add_argument("--scenario", choices=SCENARIOS, default="audit")
    p.add_argument("--out", type=Path, default=None,
                   help="benchmarks/results/decode_backpressure[_SCENARIO]_cpu")  # fmt: skip
    args = p.parse_args(argv)
    suffix = "" if args.scenario == "audit" else f"_{args.scenario}"
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"decode_backpressure{suffix}_cpu"
    engine = {**ENGINE, **SCENARIOS[args.scenario]}
    model = PinnedStack.model_dir(args.model)
    records = {}
    for name, factor in SETTINGS.items():
        print(f"backpressure {name} (decode_queue_factor={factor:g}) ...", flush=True)
        records[name] = run_setting(name, factor, model, engine)
    text = table(records)
    print(text)
    machine = machine_info()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": machine, "scenario": args.scenario, "engine": engine, "records": records},
        indent=2) + "\n")  # fmt: skip
    header = (f"# Decode backpressure on and off ({args.scenario})\n\n"
              f"`python benchmarks/decode_backpressure.py --scenario {args.scenario}`"
              f"\n\nMachine: {machine['cpu']}, {machine['cpu_count']} cores; {machine['platform']}"
              f"\n\n{__doc__.split(chr(10) * 2, 2)[2]}\n")  # fmt: skip
    write_markdown(out.with_suffix(".md"), header + "\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
