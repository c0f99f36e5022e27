"""Disaggregated (1 prefill + 1 decode worker) against colocated (2 decode workers that
prefill locally) on the same cores, under the same load sweep.

    python benchmarks/disagg_vs_colocated.py [--rates 1,2,3,4,5] [--duration 20] \
        [--out benchmarks/results/disagg_vs_colocated_cpu]

Each worker is pinned to one core with ``taskset`` (OMP_NUM_THREADS=1): disaggregated puts
the prefill worker on core A and the decode worker on core B; colocated puts one decode
worker on each. The router and this load generator are not pinned and share all cores in
both set-ups. Both stacks are up for the whole run; for each rate the two are measured
back to back (the order alternates between rates), with the same requests (same seed).
The disaggregated router has ``min_disagg_tokens=0``, so every request takes the
prefill -> KV transfer -> decode path.

Results: a side-by-side table on stdout, and ``<out>.md`` / ``.json`` / ``.png``. The
Markdown keeps everything below its notes marker across runs (hand-written analysis).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.loadgen.arrivals import LoadSpec  # noqa: E402
from benchmarks.loadgen.bench import BenchConfig, machine_info, run_benchmark  # noqa: E402
from benchmarks.loadgen.metrics import SLO, Summary  # noqa: E402
from benchmarks.loadgen.pinned_stack import PinnedStack, Placement  # noqa: E402
from benchmarks.loadgen.report import jsonable  # noqa: E402
from benchmarks.loadgen.spec import DatasetSpec  # noqa: E402
from benchmarks.records import write_markdown  # noqa: E402
from common.prometheus_text import sample_totals  # noqa: E402

DEPLOYMENTS = ("disaggregated", "colocated")


def placements(cores: tuple[int, int]) -> dict[str, list[Placement]]:
    a, b = cores
    return {
        "disaggregated": [Placement("prefill", 0, a), Placement("decode", 0, b)],
        "colocated": [Placement("decode", 0, a), Placement("decode", 1, b)],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the demo model")
    p.add_argument("--cores", default="0,1", help="the two cores to pin workers to")
    p.add_argument("--rates", default="1,2,3,4,5", help="requests per second, a sweep")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of sending per run")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--slo", default="ttft=1000,tpot=25")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "disagg_vs_colocated_cpu"
    )
    return p.parse_args(argv)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


async def measure(
    stacks: dict[str, PinnedStack], args: argparse.Namespace, rates: list[float], slo: SLO
) -> dict[str, list[Summary]]:
    summaries: dict[str, list[Summary]] = {name: [] for name in stacks}
    for index, rate in enumerate(rates):
        spec = DatasetSpec(
            "random",
            num_requests=max(4, round(rate * args.duration)),
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
        )
        order = DEPLOYMENTS if index % 2 == 0 else DEPLOYMENTS[::-1]
        for name in order:
            config = BenchConfig(
                stacks[name].base_url,
                spec,
                (LoadSpec(rate=rate),),
                slo,
                vocab_size=1000,
                seed=args.seed + index,
                progress=False,
            )
            run = (await run_benchmark(config)).runs[0]
            summaries[name].append(run.summary)
            s = run.summary
            print(
                f"  {name:>13} rate={rate:g}: {s.completed}/{s.num_requests} done, "
                f"goodput {_num(s.goodput, 2)}/s, p99 TTFT {_num(s.ttft_ms.p99, 0)} ms, "
                f"p99 ITL {_num(s.itl_ms.p99, 0)} ms",
                flush=True,
            )
    return summaries


# Router-side histograms whose means explain TTFT (pdserve's names; see router/metrics.py).
BREAKDOWN = {
    "TTFT": "vllm:time_to_first_token_seconds",
    "prefill queue": "pdserve:ttft_queue_seconds",
    "prompt compute": "pdserve:ttft_prefill_seconds",
    "KV transfer": "pdserve:kv_transfer_seconds",
    "ITL": "vllm:inter_token_latency_seconds",
}


def histogram_means_ms(text: str) -> dict[str, float | None]:
    """Mean of each BREAKDOWN histogram over the stack's life (ms; None if empty)."""
    names = [f"{metric}{suffix}" for metric in BREAKDOWN.values() for suffix in ("_sum", "_count")]
    totals = sample_totals(text, names)
    means = {}
    for label, metric in BREAKDOWN.items():
        total, count = totals.get(f"{metric}_sum", 0.0), totals.get(f"{metric}_count", 0.0)
        means[label] = 1000 * total / count if count else None
    return means


def breakdown_table(breakdowns: dict[str, dict[str, float | None]]) -> str:
    labels = list(BREAKDOWN)
    lines = [
        "| deployment | " + " | ".join(f"{x} ms" for x in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for name, means in breakdowns.items():
        cells = ["-" if means[x] is None else f"{means[x]:.1f}" for x in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def _met(s: Summary) -> float:
    """Percent of the requests sent that completed within every SLO."""
    return 100 * (s.good_requests or 0) / max(1, s.num_requests)


def table(rates: list[float], summaries: dict[str, list[Summary]]) -> str:
    lines = [
        "| rate req/s | sent/s | SLO met % D / C | goodput D / C | p99 TTFT ms D / C "
        "| p99 ITL ms D / C | p50 TTFT ms D / C | p50 ITL ms D / C | mean TPOT ms D / C "
        "| goodput D/C | p99 TTFT D/C | p99 ITL D/C |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, rate in enumerate(rates):
        d, c = summaries["disaggregated"][i], summaries["colocated"][i]
        pairs = [
            (d.goodput, c.goodput, 2),
            (d.ttft_ms.p99, c.ttft_ms.p99, 0),
            (d.itl_ms.p99, c.itl_ms.p99, 1),
            (d.ttft_ms.median, c.ttft_ms.median, 0),
            (d.itl_ms.median, c.itl_ms.median, 1),
            (d.tpot_ms.mean, c.tpot_ms.mean, 1),
        ]
        # The same schedule for both (same seed), so one sent rate.
        cells = [f"{d.send_rate:.2f}", f"{_met(d):.0f} / {_met(c):.0f}"]
        cells += [f"{_num(x, n)} / {_num(y, n)}" for x, y, n in pairs]
        ratios = [
            _ratio(d.goodput, c.goodput),
            _ratio(d.ttft_ms.p99, c.ttft_ms.p99),
            _ratio(d.itl_ms.p99, c.itl_ms.p99),
        ]
        lines.append(f"| {rate:g} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def plot(rates: list[float], summaries: dict[str, list[Summary]], slo: SLO, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("goodput (req/s, " + str(slo) + ")", lambda s: s.goodput, False),
        ("p99 TTFT (ms)", lambda s: s.ttft_ms.p99, True),
        ("p99 ITL (ms)", lambda s: s.itl_ms.p99, True),
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (title, value, log) in zip(axes, panels, strict=True):
        for name, marker in zip(DEPLOYMENTS, ("o-", "s-"), strict=True):
            ax.plot(rates, [value(s) for s in summaries[name]], marker, label=name)
        if title.startswith("goodput"):
            ax.plot(rates, rates, ":", color="gray", label="offered (nominal)")
            sent = [s.send_rate for s in summaries[DEPLOYMENTS[0]]]
            ax.plot(rates, sent, "x", color="gray", label="sent")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("1 prefill + 1 decode vs 2 colocated workers, one core each")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(
    args: argparse.Namespace,
    rates: list[float],
    slo: SLO,
    summaries: dict[str, list[Summary]],
    setup: dict[str, Any],
) -> None:
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "benchmark": "disagg_vs_colocated",
        "machine": machine_info(),
        "setup": setup,
        "rates": rates,
        "slo": str(slo),
        "summaries": {k: [jsonable(s.to_dict()) for s in v] for k, v in summaries.items()},
    }
    out.with_suffix(".json").write_text(json.dumps(body, indent=1) + "\n")
    plot(rates, summaries, slo, out.with_suffix(".png"))
    m = body["machine"]
    md = [
        "# Disaggregated vs colocated (CPU)",
        "",
        f"`python benchmarks/disagg_vs_colocated.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores; {m['platform']}; Python {m['python']}",
        "",
        f"Setup: {setup['description']}",
        "",
        f"Workload: {setup['workload']}. SLO: {slo}. D = disaggregated, C = colocated.",
        "",
        table(rates, summaries),
        "",
        "Router-side means over the whole sweep (all rates), from its Prometheus histograms:",
        "",
        breakdown_table(setup["router_means_ms"]),
        "",
        f"![disagg vs colocated]({out.with_suffix('.png').name})",
    ]
    write_markdown(out.with_suffix(".md"), "\n".join(md))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    slo = SLO.parse(args.slo)
    if slo.empty:
        raise SystemExit("--slo must set at least one limit: goodput is the comparison")
    cores = tuple(int(c) for c in args.cores.split(","))
    assert len(cores) == 2, "--cores takes two cores"
    model = PinnedStack.model_dir(args.model)
    stacks = {
        name: PinnedStack(name, model, placement) for name, placement in placements(cores).items()
    }
    started = time.monotonic()
    try:
        for stack in stacks.values():
            stack.start()
        for stack in stacks.values():
            stack.wait_ready()
        print(f"stacks ready in {time.monotonic() - started:.0f}s", flush=True)
        summaries = asyncio.run(measure(stacks, args, rates, slo))
        breakdowns = {
            name: histogram_means_ms(stack.metrics_text()) for name, stack in stacks.items()
        }
    finally:
        for stack in stacks.values():
            stack.stop()
    setup = {
        "description": (
            f"disaggregated = prefill worker on core {cores[0]} + decode worker on core "
            f"{cores[1]} (router min_disagg_tokens=0, KV over the default connector); "
            f"colocated = two decode workers (prefill.replicas=0) on cores {cores[0]} and "
            f"{cores[1]}. Workers pinned with taskset, OMP_NUM_THREADS=1; router and load "
            "generator unpinned, in both."
        ),
        "workload": (
            f"random token prompts of {args.input_len} tokens ±{args.range_ratio:.0%}, "
            f"{args.output_len} ±{args.range_ratio:.0%} output tokens (ignore_eos), Poisson "
            f"arrivals, {args.duration:g} s of sending per rate, the same requests for both"
        ),
        "model": str(model),
        "placements": {k: [dataclasses.asdict(p) for p in v] for k, v in placements(cores).items()},
        "wall_s": round(time.monotonic() - started),
        "router_means_ms": breakdowns,
    }
    print(table(rates, summaries))
    print(breakdown_table(breakdowns))
    write_results(args, rates, slo, summaries, setup)
    print(f"wrote {args.out}.md/.json/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
