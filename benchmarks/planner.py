"""Does ``pdserve plan`` predict what a stack sees? Two profiles: the engine alone on one
pinned core (``plan profile``), and the running stack through its router (``plan profile
--base-url``); then the 1 prefill + 1 decode stack (each worker pinned to its own core)
under Poisson load at fractions of the rate the stack profile says 1P1D can take within
the targets; each profile's predicted mean TTFT and ITL beside the measured ones, and the
stack profile's p90s beside the measured p90s.

    python benchmarks/planner.py [--fractions 0.4,0.7,1.0,1.3] [--duration 30] \
        [--ttft-ms 400 --itl-ms 20] [--out benchmarks/results/planner_cpu]

The engine profile runs under ``taskset`` on the prefill worker's core with
OMP_NUM_THREADS=1, as the workers run. The router and this load generator are not pinned:
they share the two cores with the workers, which only the stack profile sees. Every
request takes the disaggregated path (``min_disagg_tokens: 0``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.loadgen.arrivals import LoadSpec  # noqa: E402
from benchmarks.loadgen.bench import BenchConfig, machine_info, run_benchmark  # noqa: E402
from benchmarks.loadgen.metrics import SLO, Summary  # noqa: E402
from benchmarks.loadgen.pinned_stack import PinnedStack, Placement  # noqa: E402
from benchmarks.records import write_record  # noqa: E402
from planner.demand import Demand, RequestShape  # noqa: E402
from planner.profile_data import Profile, read_profile  # noqa: E402
from planner.sizing import Sizing, Targets, predict  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the demo model")
    p.add_argument("--cores", default="0,1", help="prefill core, decode core")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-ms", type=float, default=400.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--fractions", default="0.4,0.7,1.0,1.3", help="of the planned capacity")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of sending per rate")
    p.add_argument("--out", type=Path,
                   default=REPO_ROOT / "benchmarks" / "results" / "planner_cpu")  # fmt: skip
    return p.parse_args(argv)


def profile_pinned(stack: PinnedStack, core: int, out: Path, args: argparse.Namespace) -> None:
    command = ["taskset", "-c", str(core), sys.executable, "-m", "deploy.cli", "plan",
               "profile", "--config", str(stack.config_path), "--out", str(out),
               *_grid_flags(args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, cwd=REPO_ROOT, env=env)


def profile_stack(stack: PinnedStack, out: Path, args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "deploy.cli", "plan", "profile", "--config",
               str(stack.config_path), "--base-url", stack.base_url, "--out", str(out),
               *_grid_flags(args)]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO_ROOT)


def _grid_flags(args: argparse.Namespace) -> list[str]:
    isls = sorted({128, args.input_len // 2, args.input_len, args.input_len * 2})
    contexts = sorted({256, args.input_len + args.output_len // 2, 2048})
    return ["--isl", ",".join(map(str, isls)), "--batch", "1,2,4,8,16,32,64",
            "--context", ",".join(map(str, contexts))]  # fmt: skip


def capacity(profile: Profile, shape: RequestShape, targets: Targets) -> float:
    """The highest rate at which 1P1D meets both targets (bisection: misses only grow
    with the rate)."""

    def meets(rate: float) -> bool:
        sizing = predict(profile, Demand(rate, (shape,)), targets, 1, 1)
        return not sizing.prefill.limit and not sizing.decode.limit

    low, high = 0.0, 1.0
    while meets(high):
        low, high = high, high * 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


async def measure(stack: PinnedStack, args: argparse.Namespace, rate: float, seed: int) -> Summary:
    from benchmarks.loadgen.spec import DatasetSpec

    spec = DatasetSpec("random", num_requests=max(8, round(rate * args.duration)),
                       input_len=args.input_len, output_len=args.output_len)  # fmt: skip
    config = BenchConfig(stack.base_url, spec, (LoadSpec(rate=rate),), SLO(), vocab_size=1000,
                         seed=seed, progress=False)  # fmt: skip
    return (await run_benchmark(config)).runs[0].summary


def row(
    fraction: float, rate: float, sizings: dict[str, Sizing], p90: Sizing, summary: Summary
) -> dict:
    out = {
        "fraction": fraction,
        "rate_per_s": rate,
        "sent_per_s": summary.send_rate,
        "completed": summary.completed,
        "num_requests": summary.num_requests,
        "measured_ttft_ms": summary.ttft_ms.mean,
        "measured_itl_ms": summary.itl_ms.mean,
        "measured_p90_ttft_ms": summary.ttft_ms.p90,
        "measured_p90_itl_ms": summary.itl_ms.p90,
    }
    for name, sizing in sizings.items():
        out[name] = {
            "ttft_ms": sizing.prefill.ttft_s * 1000,
            "itl_ms": sizing.decode.itl_s * 1000,
            "prefill_utilization": sizing.prefill.utilization,
            "decode_batch": sizing.decode.batch,
            "misses": [sizing.prefill.limit, sizing.decode.limit],
        }
    out["stack"]["p90_ttft_ms"] = p90.prefill.ttft_s * 1000
    out["stack"]["p90_itl_ms"] = p90.decode.itl_s * 1000
    return out


def _worker_use(before: dict, after: dict, wall_s: float) -> dict:
    """Each worker's engine over a run, from its Stats: how busy, and its mean step."""
    use = {}
    for role in before:
        steps = after[role].engine_steps - before[role].engine_steps
        busy_s = after[role].engine_busy_seconds - before[role].engine_busy_seconds
        use[role] = {"busy": busy_s / wall_s, "mean_step_ms": 1000 * busy_s / max(steps, 1)}
    return use


def _cell(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return "inf" if value == float("inf") else f"{value:.{digits}f}"


def _ratio(measured: float | None, predicted: float) -> str:
    if measured is None or predicted in (0, float("inf")):
        return "-"
    return f"{measured / predicted:.2f}"


def markdown(args: argparse.Namespace, rows: list[dict], setup: dict) -> str:
    m = setup["machine"]
    lines = [
        "# Planner: predicted against measured (CPU)",
        "",
        f"`python benchmarks/planner.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores; {m['platform']}; Python {m['python']}",
        "",
        setup["description"],
        "",
        f"Targets: mean TTFT {args.ttft_ms:g} ms, mean ITL {args.itl_ms:g} ms. 1P1D capacity "
        f"for them: **{setup['capacity_per_s']['stack']:.2f} requests/s** by the stack profile, "
        f"{setup['capacity_per_s']['engine']:.2f} by the engine profile. Means, then p90s "
        "(the stack profile's); ratio = measured / predicted (1.00: exact).",
        "",
        "| x capacity | rate /s | sent /s | done | TTFT ms measured | stack profile | ratio | "
        "engine profile | ratio | ITL ms measured | stack profile | ratio | engine profile | "
        "ratio | p90 TTFT ms | stack profile | ratio | p90 ITL ms | stack profile | ratio | "
        "misses predicted (stack: P / D) | engine busy P / D | decode engine's mean step ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|---:|---|---|---:|",
    ]
    for r in rows:
        stack, engine = r["stack"], r["engine"]
        lines.append(
            f"| {r['fraction']:g} | {r['rate_per_s']:.2f} | {r['sent_per_s']:.2f} | "
            f"{r['completed']}/{r['num_requests']} | {_cell(r['measured_ttft_ms'], 0)} | "
            f"{_cell(stack['ttft_ms'], 0)} | {_ratio(r['measured_ttft_ms'], stack['ttft_ms'])} | "
            f"{_cell(engine['ttft_ms'], 0)} | {_ratio(r['measured_ttft_ms'], engine['ttft_ms'])} | "
            f"{_cell(r['measured_itl_ms'])} | {_cell(stack['itl_ms'])} | "
            f"{_ratio(r['measured_itl_ms'], stack['itl_ms'])} | {_cell(engine['itl_ms'])} | "
            f"{_ratio(r['measured_itl_ms'], engine['itl_ms'])} | "
            f"{_cell(r['measured_p90_ttft_ms'], 0)} | {_cell(stack['p90_ttft_ms'], 0)} | "
            f"{_ratio(r['measured_p90_ttft_ms'], stack['p90_ttft_ms'])} | "
            f"{_cell(r['measured_p90_itl_ms'])} | {_cell(stack['p90_itl_ms'])} | "
            f"{_ratio(r['measured_p90_itl_ms'], stack['p90_itl_ms'])} | "
            f"{stack['misses'][0] or '-'} / {stack['misses'][1] or '-'} | "
            f"{r['workers']['prefill']['busy']:.0%} / {r['workers']['decode']['busy']:.0%} | "
            f"{r['workers']['decode']['mean_step_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = tuple(int(c) for c in args.cores.split(","))
    model = PinnedStack.model_dir(args.model)
    placements = [Placement("prefill", 0, cores[0]), Placement("decode", 0, cores[1])]
    stack = PinnedStack("planner", model, placements)
    started = time.monotonic()
    paths = {name: args.out.with_name(f"{args.out.name}_{name}_profile.json")
             for name in ("engine", "stack")}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    targets = Targets(args.ttft_ms / 1000, args.itl_ms / 1000, min_disagg_tokens=0)
    p90_targets = dataclasses.replace(targets, ttft_percentile=90, itl_percentile=90)
    shape = RequestShape(args.input_len, args.input_len, args.output_len)
    rows = []
    try:
        profile_pinned(stack, cores[0], paths["engine"], args)
        stack.start()
        stack.wait_ready()
        profile_stack(stack, paths["stack"], args)
        profiles = {name: read_profile(path) for name, path in paths.items()}
        caps = {name: capacity(p, shape, targets) for name, p in profiles.items()}
        print(f"planned 1P1D capacity: {caps['stack']:.2f} requests/s (stack profile), "
              f"{caps['engine']:.2f} (engine profile)", flush=True)  # fmt: skip
        for i, fraction in enumerate(float(f) for f in args.fractions.split(",")):
            rate = fraction * caps["stack"]
            sizings = {name: predict(p, Demand(rate, (shape,)), targets, 1, 1)
                       for name, p in profiles.items()}  # fmt: skip
            p90 = predict(profiles["stack"], Demand(rate, (shape,)), p90_targets, 1, 1)
            before = {role: stack.worker_stats(role) for role in ("prefill", "decode")}
            started_at = time.monotonic()
            summary = asyncio.run(measure(stack, args, rate, seed=i))
            wall_s = time.monotonic() - started_at
            after = {role: stack.worker_stats(role) for role in ("prefill", "decode")}
            rows.append(row(fraction, rate, sizings, p90, summary))
            rows[-1]["workers"] = _worker_use(before, after, wall_s)
            r = rows[-1]
            print(f"  x{fraction:g} ({rate:.2f}/s): TTFT measured {_cell(r['measured_ttft_ms'], 0)}"
                  f", predicted {_cell(r['stack']['ttft_ms'], 0)} (stack) "
                  f"{_cell(r['engine']['ttft_ms'], 0)} (engine); ITL measured "
                  f"{_cell(r['measured_itl_ms'])}, predicted {_cell(r['stack']['itl_ms'])} / "
                  f"{_cell(r['engine']['itl_ms'])} ms", flush=True)  # fmt: skip
    finally:
        stack.stop()
    setup = {
        "machine": machine_info(),
        "description": (
            f"Model {model.name}; prompts of {args.input_len} random tokens, "
            f"{args.output_len} output tokens (ignore_eos), Poisson arrivals, "
            f"{args.duration:g} s of sending per rate. Prefill worker on core {cores[0]}, "
            f"decode worker on core {cores[1]} (taskset, OMP_NUM_THREADS=1); the engine "
            f"profile measured on core {cores[0]} the same way, before the stack started; "
            "the stack profile through the idle stack's router; router and load generator "
            "unpinned."
        ),
        "capacity_per_s": caps,
        "profiles": {name: json.loads(path.read_text()) for name, path in paths.items()},
        "wall_s": round(time.monotonic() - started),
    }
    record = {"benchmark": "planner", "setup": setup, "rows": rows}
    write_record(args.out, record, markdown(args, rows, setup))
    print(markdown(args, rows, setup))
    print(f"wrote {args.out}.md/.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
