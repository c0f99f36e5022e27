"""``pdserve plan profile|size``: choose the prefill:decode layout from measurements.

``profile`` measures the config's engine on this machine (prefill speed by prompt length,
decode step time by batch and context) and writes a JSON profile; with ``--base-url`` it
measures a running stack of that config through its router instead, as a client sees it
(the services' own costs included: use it where they are not small beside a step).
``size`` reads a profile and a demand (a steady load from flags, or a Mooncake / Azure
trace cut into windows) and prints how many prefill and decode workers meet the TTFT and
ITL targets, and the ``pdserve up`` line that runs that layout. The model behind the numbers:
``planner/sizing.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from deploy.config_args import add_overrides, int_list, load_or_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    profile = actions.add_parser(
        "profile", help="measure the config's engine; write a profile (JSON)"
    )
    profile.add_argument("--config", default=None, help="deployment YAML (default: built-in)")
    add_overrides(profile)
    profile.add_argument("--out", type=Path, default=Path("pdserve-profile.json"))
    profile.add_argument("--isl", type=int_list, default=(), help="prompt lengths, e.g. 512,2048")
    profile.add_argument("--batch", type=int_list, default=(), help="decode batches, e.g. 1,8,64")
    profile.add_argument("--context", type=int_list, default=(), help="decode contexts (tokens)")
    profile.add_argument("--steps", type=int, default=12, help="decode steps timed per point")
    profile.add_argument(
        "--base-url", default=None,
        help="measure this running stack through its router (its --config), timing what a "
             "client sees, instead of the engine alone in this process",
    )  # fmt: skip
    profile.add_argument("--api-key", default=None, help="the router's key, if it has one")

    size = actions.add_parser("size", help="workers per role for a demand and latency targets")
    size.add_argument("--profile", type=Path, required=True, help="from `pdserve plan profile`")
    size.add_argument("--config", default=None, help="deployment YAML (min_disagg_tokens)")
    add_overrides(size)
    size.add_argument("--ttft-ms", type=float, required=True, help="TTFT target (a mean)")
    size.add_argument("--itl-ms", type=float, required=True, help="inter-token target (a mean)")
    size.add_argument("--ttft-percentile", type=float, default=None, metavar="P",
                      help="make --ttft-ms a percentile (90: a p90) instead of a mean")  # fmt: skip
    size.add_argument("--itl-percentile", type=float, default=None, metavar="P",
                      help="make --itl-ms a percentile instead of a mean")  # fmt: skip
    size.add_argument("--max-utilization", type=float, default=0.85,
                      help="busiest a worker may be planned (default: %(default)s)")  # fmt: skip
    steady = size.add_argument_group("a steady load")
    steady.add_argument("--rate", type=float, help="requests per second")
    steady.add_argument("--isl", type=int, help="prompt tokens")
    steady.add_argument("--osl", type=int, help="output tokens")
    steady.add_argument("--cached-tokens", type=int, default=0, help="of each prompt, cached")
    trace = size.add_argument_group("or a trace")
    trace.add_argument("--dataset", choices=("mooncake", "azure"))
    trace.add_argument("--trace", type=Path, default=None, help="default: the shared traces")
    trace.add_argument("--num-requests", type=int, default=None, help="default: all rows")
    trace.add_argument("--trace-offset", type=int, default=0)
    trace.add_argument("--input-scale", type=float, default=1.0)
    trace.add_argument("--output-scale", type=float, default=1.0)
    trace.add_argument("--rate-scale", type=float, default=1.0,
                       help="arrivals this many times as fast")  # fmt: skip
    trace.add_argument("--window", type=float, default=60.0, help="seconds per window")
    trace.add_argument("--cache-tokens", type=int, default=None,
                       help="prefix cache Mooncake's blocks replay through (default: one "
                            "prefill worker's KV pool)")  # fmt: skip
    size.add_argument("--layout", type=_layout, default=None, metavar="P,D",
                      help="predict this layout (prefill, decode workers) instead of sizing "
                           "one: what it would see, and the targets it misses")  # fmt: skip
    size.add_argument("--out", type=Path, default=None, help="write every window's sizing (JSON)")


def _layout(text: str) -> tuple[int, int]:
    values = int_list(text)
    if len(values) != 2 or values[0] < 0 or values[1] < 1:
        raise argparse.ArgumentTypeError(
            f"expected PREFILL,DECODE workers (>= 0 and >= 1), got {text!r}"
        )
    return values[0], values[1]


def run(args: argparse.Namespace) -> int:
    config = load_or_report(args.config, args.overrides)
    if config is None:
        return 2
    try:
        if args.out is not None:  # (before the measuring: a bad path lost the results)
            _check_writable(args.out)
        if args.action == "profile":
            return _profile(config, args)
        return _size(config, args)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _up_overrides(args: argparse.Namespace, prefill: int, decode: int) -> list[str]:
    """The ``--set`` values of the ``pdserve up`` line that runs the sized layout: the
    ones this command was given (the line ran another setup than the one sized, e.g.
    without ``router.min_disagg_tokens``), the replica counts, and the decode workers'
    base port moved past the prefill workers' where there are too many of those for the
    default ports (16 prefill workers overlapped the decode ports: the line did not
    start; an audit)."""
    from common.config import PORT_STRIDE
    from common.config_loader import load_config

    overrides = [*args.overrides, f"prefill.replicas={prefill}", f"decode.replicas={decode}"]
    try:
        load_config(args.config, overrides)
    except ConfigError as exc:
        if not exc.key.startswith(("prefill.port", "decode.port")):
            raise
        config = load_config(args.config, args.overrides)
        overrides.append(f"decode.port={config.prefill.port + prefill * PORT_STRIDE}")
        load_config(args.config, overrides)  # (a clash with another port: said as it is)
    return overrides


def _check_writable(path: Path) -> None:
    """``--out`` can be written: its directory exists and is one, and the path is not one."""
    parent = path.parent  # (Path("p.json").parent is ".")
    if not parent.is_dir():
        raise ValueError(f"--out {path}: the directory {parent} does not exist")
    if path.is_dir():
        raise ValueError(f"--out {path} is a directory; give a file name")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--out {path} cannot be written here (permissions)")


def _profile(config: PdserveConfig, args: argparse.Namespace) -> int:
    from planner.grid import Grid
    from planner.profile_data import write_profile

    grid = Grid(tuple(args.isl), tuple(args.batch), tuple(args.context), measured_steps=args.steps)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.base_url is None:
        from planner.profiler import profile_deployment

        profile = profile_deployment(config, grid, progress)
    else:
        import asyncio

        from planner.stack_profiler import profile_stack

        profile = asyncio.run(profile_stack(args.base_url, config, grid, progress, args.api_key))
    write_profile(profile, args.out)
    print(f"wrote {args.out} ({len(profile.prefill.prefill)} prefill points, "
          f"{len(profile.decode.decode)} decode points, {profile.machine})")  # fmt: skip
    return 0


def _size(config: PdserveConfig, args: argparse.Namespace) -> int:
    from planner.demand import Demand, RequestShape, windows
    from planner.profile_data import read_profile
    from planner.sizing import Targets, describe, predict, size

    profile = read_profile(args.profile)
    for warning in _profile_mismatches(config, profile):
        print(f"warning: {warning}", file=sys.stderr)
    targets = Targets(
        args.ttft_ms / 1000, args.itl_ms / 1000, args.max_utilization,
        config.router.min_disagg_tokens, args.ttft_percentile, args.itl_percentile,
    )  # fmt: skip
    steady = (args.rate, args.isl, args.osl)
    if (args.dataset is None) == (None in steady):
        raise ValueError("give a steady load (--rate, --isl, --osl) or a trace (--dataset), "
                         "one of them")  # fmt: skip
    if args.dataset is not None:
        demands = windows(_trace_requests(args, profile), args.window)
    else:
        max_model_len = profile.decode.engine.max_model_len
        if args.isl + args.osl > max_model_len:
            raise ValueError(
                f"--isl {args.isl} + --osl {args.osl} exceed the profiled "
                f"max_model_len ({max_model_len}): the engine would refuse them"
            )
        if not 0 <= args.cached_tokens < args.isl:
            raise ValueError(f"--cached-tokens must be in [0, --isl {args.isl}), "
                             f"got {args.cached_tokens}")  # fmt: skip
        shape = RequestShape(args.isl, args.isl - args.cached_tokens, args.osl)
        demands = [Demand(args.rate, (shape,))]
    if args.layout is not None:
        sizings = [predict(profile, demand, targets, *args.layout) for demand in demands]
    else:
        sizings = [size(profile, demand, targets) for demand in demands]
    prefill = max(s.prefill.replicas for s in sizings)
    decode = max(s.decode.replicas for s in sizings)
    why = "misses" if args.layout is not None else "one fewer"
    if len(demands) == 1:
        _print_one(demands[0], sizings[0], targets, why)
    else:
        _print_windows(demands, sizings, targets, args.window, why)
    if args.layout is not None:
        missed = sum(bool(s.prefill.limit or s.decode.limit) for s in sizings)
        print(f"layout: {prefill} prefill + {decode} decode misses a target in {missed} of "
              f"{len(sizings)} window{'s' if len(sizings) > 1 else ''}")  # fmt: skip
    else:
        command = ["pdserve", "up"] + (["--config", args.config] if args.config else [])
        for override in _up_overrides(args, prefill, decode):
            command += ["--set", override]
        print(f"layout: {prefill} prefill + {decode} decode\n  {shlex.join(command)}")
    sys.stdout.flush()
    for warning in describe(note for s in sizings for note in s.notes):
        print(f"warning: {warning}", file=sys.stderr)
    if args.out is not None:
        record = {
            "profile": str(args.profile), "targets": asdict(targets),
            "layout": {"prefill": prefill, "decode": decode},
            "windows": [
                {"start_s": d.start_s, "rate_per_s": d.rate_per_s,
                 "num_requests": len(d.shapes), **asdict(s)}
                for d, s in zip(demands, sizings, strict=True)
            ],
        }  # fmt: skip
        args.out.write_text(json.dumps(_finite(record), indent=2, allow_nan=False) + "\n")
    return 0


def _finite(value):
    """``value`` with its infinite numbers (an overloaded role's predicted TTFT) as null:
    JSON has no Infinity, and JavaScript's and strict parsers refuse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _trace_requests(args: argparse.Namespace, profile):
    from benchmarks.loadgen.traces import default_trace
    from planner.traces import TraceOptions, azure_requests, mooncake_requests

    path = args.trace or default_trace(args.dataset)
    if not path.exists():
        raise FileNotFoundError(f"trace {path} not found (pass --trace or set PDSERVE_TRACES)")
    cache_tokens = args.cache_tokens
    if cache_tokens is None:
        cache_tokens = profile.prefill.engine.kv_capacity_tokens
    options = TraceOptions(
        args.num_requests, args.trace_offset, args.input_scale, args.output_scale,
        args.rate_scale, profile.prefill.engine.max_model_len, cache_tokens,
    )  # fmt: skip
    read = mooncake_requests if args.dataset == "mooncake" else azure_requests
    try:
        return read(path, options)
    except (ValueError, KeyError, TypeError) as exc:  # (JSON's errors are ValueErrors)
        raise ValueError(f"trace {path} is not a {args.dataset} trace: {exc}") from None


def _profile_mismatches(config: PdserveConfig, profile) -> list[str]:
    """Where the config's engines are not the ones profiled: the sizing would be of
    another deployment."""
    problems = []
    for role, facts in ((Role.PREFILL, profile.prefill.engine),
                        (Role.DECODE, profile.decode.engine)):  # fmt: skip
        engine = config.engine_for(role)
        for key in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                    "tensor_parallel_size"):  # fmt: skip
            if getattr(engine, key) != getattr(facts, key):
                problems.append(f"{role}.engine.{key} is {getattr(engine, key)} here but "
                                f"{getattr(facts, key)} in the profile")  # fmt: skip
        # None here is the model's context, what the profile's engine took (its own None).
        if engine.max_model_len is not None and engine.max_model_len != facts.max_model_len:
            problems.append(f"{role}.engine.max_model_len is {engine.max_model_len} here but "
                            f"{facts.max_model_len} in the profile (the trace is clipped to "
                            "the profile's)")  # fmt: skip
    return problems


def _print_one(demand, sizing, targets, why: str = "one fewer") -> None:
    shape_isl = sum(s.isl for s in demand.shapes) / len(demand.shapes)
    shape_osl = sum(s.osl for s in demand.shapes) / len(demand.shapes)
    print(f"demand: {demand.rate_per_s:.2f} requests/s, {shape_isl:.0f} prompt tokens, "
          f"{shape_osl:.0f} output tokens")  # fmt: skip
    p, d = sizing.prefill, sizing.decode
    why_p = f" ({why}: {p.limit})" if p.limit else ""
    why_d = f" ({why}: {d.limit})" if d.limit else ""
    if p.replicas:
        print(f"prefill: {_workers(p.replicas)}, {p.utilization:.0%} busy, "
              f"{targets.ttft_statistic} TTFT {p.ttft_s * 1000:.0f} ms{why_p}")  # fmt: skip
    elif p.ttft_s:
        print(f"prefill: 0 workers: the decode workers prefill every prompt, "
              f"{targets.ttft_statistic} TTFT {p.ttft_s * 1000:.0f} ms{why_p}")  # fmt: skip
    else:
        print("prefill: 0 workers: no prompt is long enough to disaggregate")
    print(f"decode:  {_workers(d.replicas)}, {d.utilization:.0%} busy, {d.batch:.1f} requests "
          f"in flight each, {targets.itl_statistic} ITL "
          f"{d.itl_s * 1000:.1f} ms, KV {d.kv_fraction:.0%}, prefilling short prompts "
          f"{d.local_prefill_fraction:.0%} of the time{why_d}")  # fmt: skip


def _workers(count: int) -> str:
    return f"{count} worker" + ("" if count == 1 else "s")


def _print_windows(demands, sizings, targets, window_s: float, why: str) -> None:
    peak = max(range(len(demands)), key=lambda i: demands[i].rate_per_s)
    layouts = Counter((s.prefill.replicas, s.decode.replicas) for s in sizings)
    print(
        f"{len(demands)} windows of {window_s:.0f} s; layouts needed (prefill, decode): "
        + ", ".join(f"{p}P{d}D in {n}" for (p, d), n in sorted(layouts.items()))
    )
    print(f"busiest window, from {demands[peak].start_s:.0f} s:")
    _print_one(demands[peak], sizings[peak], targets, why)


COMMAND = ("choose the prefill:decode layout: profile the engine, size for a load", add_arguments,
           run)  # fmt: skip
