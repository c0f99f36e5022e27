"""``pdserve bench``: offer a dataset to an OpenAI-compatible server and report latency,
throughput and SLO goodput (JSON, Markdown, PNG plots).

Load, in this order of precedence:
* ``--concurrency 1,4,8``: closed loop, one run per value;
* ``--rate R`` or ``--rates 1,2,4``: open loop (Poisson; Gamma with ``--burstiness``), one run
  per rate. Trace datasets keep their arrival pattern, scaled to each mean rate, unless
  ``--no-replay`` asks for Poisson/Gamma arrivals instead;
* neither: trace datasets replay their own times (``--time-scale``); the others send every
  request at once.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
from pathlib import Path

from deploy.config_args import float_list, int_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.loadgen.spec import DATASETS, DEFAULT_VOCAB_SIZE, DatasetSpec

    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    d = DatasetSpec("random")
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="OpenAI base URL (default: %(default)s)",
    )
    server.add_argument("--model", default=None, help="default: the first model listed")
    server.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer key (default: $OPENAI_API_KEY)",
    )
    server.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="per request, seconds (the whole stream, not each read)",
    )
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--num-requests", type=int, default=d.num_requests)
    data.add_argument(
        "--input-len",
        type=int,
        default=d.input_len,
        help="prompt tokens (prefix-repetition: the suffix; multi-turn: per turn)",
    )
    data.add_argument("--output-len", type=int, default=d.output_len)
    data.add_argument(
        "--range-ratio", type=float, default=d.range_ratio, help="lengths uniform in len*(1±r)"
    )
    data.add_argument("--prefix-len", type=int, default=d.prefix_len)
    data.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    data.add_argument("--turns", type=int, default=d.turns)
    data.add_argument("--think-time", type=float, default=d.think_time_s, help="seconds")
    data.add_argument("--trace", type=Path, default=None, help="default: the shared traces")
    data.add_argument("--trace-offset", type=int, default=0, help="trace rows to skip")
    data.add_argument(
        "--block-tokens",
        type=int,
        default=d.block_tokens,
        help="mooncake: tokens per hash id (the trace's blocks are 512)",
    )
    data.add_argument("--input-scale", type=float, default=1.0, help="azure prompt lengths x")
    data.add_argument("--output-scale", type=float, default=1.0, help="trace output lengths x")
    data.add_argument("--max-input-tokens", type=int, default=None)
    data.add_argument("--max-output-tokens", type=int, default=None)
    data.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="synthetic ids are drawn below this",
    )
    data.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--rate", type=float, default=None, help="sessions per second")
    load.add_argument("--rates", type=float_list, default=None, help="a sweep, e.g. 1,2,4")
    load.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson")
    load.add_argument("--concurrency", type=int_list, default=None, help="closed loop, e.g. 1,4")
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight"
    )
    load.add_argument(
        "--replay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trace datasets: use the trace's arrival pattern (default: yes)",
    )
    load.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="replay without a rate: trace times x this (0.5 = twice as fast)",
    )
    load.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop sending new requests after this many seconds",
    )
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--slo", default="", help="e.g. ttft=500,tpot=50 (ms; also e2e)")
    load.add_argument(
        "--priority-mix",
        default=None,
        help="send priorities, PRIORITY:WEIGHT per class, e.g. 0:1,1:3 (a quarter of the "
        "sessions at 0); the report then has a table per class",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench-results"), help="directory")
    out.add_argument("--name", default=None, help="file name stem (default: bench_DATASET)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")


def build_loads(args: argparse.Namespace) -> list:
    from benchmarks.loadgen.arrivals import LoadSpec
    from benchmarks.loadgen.spec import TRACE_DATASETS

    if args.rate is not None and args.rates is not None:
        raise ValueError("give --rate or --rates, not both")
    # Each of these was ignored beside the other, without a word.
    rated = args.rate is not None or args.rates is not None
    if args.concurrency is not None and (rated or args.max_concurrency is not None):
        raise ValueError("--concurrency is a closed loop: give it without --rate, --rates or "
                         "--max-concurrency")  # fmt: skip
    if rated and args.time_scale != 1.0:
        raise ValueError("--time-scale scales a trace's own times: give it without a rate")
    replay = args.replay if args.replay is not None else args.dataset in TRACE_DATASETS
    if replay and args.dataset not in TRACE_DATASETS:
        raise ValueError("--replay needs a trace dataset (mooncake, azure)")
    common = dict(duration_s=args.duration, burstiness=args.burstiness)
    if args.concurrency is not None:
        return [LoadSpec(concurrency=c, **common) for c in args.concurrency]
    rates = args.rates or ([args.rate] if args.rate is not None else None)
    if rates is not None:
        return [
            LoadSpec(rate=r, replay=replay, max_concurrency=args.max_concurrency, **common)
            for r in rates
        ]
    return [
        LoadSpec(
            math.inf,
            replay=replay,
            time_scale=args.time_scale,
            max_concurrency=args.max_concurrency,
            **common,
        )
    ]


def build_config(args: argparse.Namespace):
    from benchmarks.loadgen.bench import BenchConfig
    from benchmarks.loadgen.metrics import SLO
    from benchmarks.loadgen.priorities import PriorityMix
    from benchmarks.loadgen.spec import DatasetSpec

    spec = DatasetSpec(
        name=args.dataset,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        turns=args.turns,
        think_time_s=args.think_time,
        trace=args.trace,
        trace_offset=args.trace_offset,
        block_tokens=args.block_tokens,
        input_scale=args.input_scale,
        output_scale=args.output_scale,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    return BenchConfig(
        base_url=args.base_url,
        dataset=spec,
        loads=tuple(build_loads(args)),
        slo=SLO.parse(args.slo),
        model=args.model,
        api_key=args.api_key,
        vocab_size=args.vocab_size,
        seed=args.seed,
        warmup_requests=args.warmup,
        timeout_s=args.timeout,
        temperature=args.temperature,
        progress=not args.no_progress,
        priorities=PriorityMix.parse(args.priority_mix, args.seed) if args.priority_mix else None,
    )


def _redacted(argv: list[str], api_key: str | None) -> list[str]:
    """The command line as typed, with the API key replaced."""
    out = []
    for arg in argv:
        if arg.startswith("--api-key="):
            arg = "--api-key=***"
        elif api_key and arg == api_key:
            arg = "***"
        out.append(arg)
    return out


def run(args: argparse.Namespace) -> int:
    import httpx

    from benchmarks.loadgen.bench import run_benchmark
    from benchmarks.loadgen.report import priority_table, summary_table, write_report

    try:
        config = build_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run_benchmark(config))
    except (httpx.HTTPError, RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    command = "pdserve " + shlex.join(_redacted(sys.argv[1:], args.api_key))
    name = args.name or f"bench_{args.dataset.replace('-', '_')}"
    paths = write_report(report, args.out, name, command, plots=not args.no_plots)
    print(summary_table(report))
    if report.runs and report.runs[0].by_priority:
        print(priority_table(report))
    for run_report in report.runs:
        s = run_report.summary
        if s.failed or s.wrong_length or run_report.not_sent:
            print(
                f"{run_report.label}: {s.failed} failed, {s.wrong_length} with a wrong output "
                f"length, {run_report.not_sent} not sent",
                file=sys.stderr,
            )
    print("wrote " + ", ".join(str(p) for p in paths))
    # Failed requests are a result (an overloaded server refuses some); no answer at all is not.
    return 0 if any(r.summary.completed for r in report.runs) else 1


COMMAND = ("benchmark a server: latency, throughput and SLO goodput", add_arguments, run)
