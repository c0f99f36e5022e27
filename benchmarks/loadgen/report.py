"""A benchmark report as JSON (everything, per request) and Markdown (the summary table).

The JSON keeps each request's raw timeline (chunk arrival times and token counts), so any
metric can be recomputed later with other definitions. Non-finite numbers (an infinite
offered rate) are written as strings, keeping the file valid JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.loadgen.bench import BenchConfig, BenchReport, RunReport
from benchmarks.loadgen.client import RequestResult
from benchmarks.loadgen.metrics import Stats

FORMAT_VERSION = 1


def jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    return value


def config_dict(config: BenchConfig) -> dict[str, Any]:
    """The config as JSON values, without the API key."""
    body = jsonable(config)
    if body.get("api_key"):
        body["api_key"] = "***"
    return body


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def request_record(result: RequestResult) -> dict[str, Any]:
    return {
        "session": result.session_id,
        "turn": result.turn,
        "prompt_tokens": result.prompt_tokens,
        "expected_output_tokens": result.expected_output_tokens,
        "output_tokens": result.output_tokens,
        "start_ms": _ms(result.start_s),
        "end_ms": _ms(result.end_s),
        "ttft_ms": _ms(result.ttft_s),
        "chunk_times_ms": [_ms(t) for t in result.chunk_times_s],
        "chunk_tokens": result.chunk_tokens,
        "exact_counts": result.exact_counts,
        "error": result.error,
        "priority": result.priority,
    }


def run_record(run: RunReport) -> dict[str, Any]:
    return {
        "label": run.label,
        "load": jsonable(run.load),
        "seed": run.seed,
        "not_sent": run.not_sent,
        "notes": list(run.notes),
        "server_prefix_hit_rate": run.server_prefix_hit_rate,
        "summary": jsonable(run.summary.to_dict()),
        "by_priority": {str(p): jsonable(s.to_dict()) for p, s in run.by_priority.items()},
        "requests": [request_record(r) for r in run.results],
    }


def report_dict(report: BenchReport) -> dict[str, Any]:
    return {
        "benchmark": "pdserve bench",
        "format_version": FORMAT_VERSION,
        "created": report.created,
        "machine": report.machine,
        "server": report.server,
        "config": config_dict(report.config),
        "runs": [run_record(run) for run in report.runs],
    }


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _dist(stats: Stats, *fields: str) -> str:
    return " / ".join(_f(getattr(stats, name)) for name in fields)


# What the table's latencies are, where they differ from ``vllm bench serve``'s (whose ITL
# is one gap per chunk, the first skipped: merged chunks, under speculative decoding or a
# router that lags, read 4x lower here than there; an audit).
ITL_DEFINITION = (
    "ITL here is per token: a chunk of k tokens after a gap g counts k gaps of g/k "
    "(vLLM's bench counts one gap g per chunk); TPOT is (last - first token) / (n - 1), "
    "as vLLM's; E2E ends at the stream's [DONE]."
)


def summary_table(report: BenchReport) -> str:
    """One Markdown row per run."""
    lines = [
        "| run | sent/s | done / sent | req/s | out tok/s | goodput req/s "
        "| TTFT ms mean / p50 / p99 | TPOT ms mean / p99 | ITL ms p50 / p99 | E2E ms p50 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report.runs:
        s = run.summary
        lines.append(
            f"| {run.label} | {_f(s.send_rate, 2)} | {s.completed} / {s.num_requests} "
            f"| {_f(s.request_throughput, 2)} | {_f(s.output_token_throughput)} "
            f"| {_f(s.goodput, 2)} "
            f"| {_dist(s.ttft_ms, 'mean', 'median', 'p99')} | {_dist(s.tpot_ms, 'mean', 'p99')} "
            f"| {_dist(s.itl_ms, 'median', 'p99')} | {_dist(s.e2e_ms, 'median', 'p99')} |"
        )
    return "\n".join(lines)


def priority_table(report: BenchReport) -> str:
    """One Markdown row per (run, priority class); empty without a priority mix."""
    rows = [(run, priority, summary) for run in report.runs
            for priority, summary in run.by_priority.items()]  # fmt: skip
    if not rows:
        return ""
    lines = [
        "| run | priority | done / sent | goodput req/s | TTFT ms p50 / p90 / p99 "
        "| TPOT ms mean / p99 | E2E ms p50 / p90 / p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, priority, s in rows:
        lines.append(
            f"| {run.label} | {priority} | {s.completed} / {s.num_requests} | {_f(s.goodput, 2)} "
            f"| {_dist(s.ttft_ms, 'median', 'p90', 'p99')} | {_dist(s.tpot_ms, 'mean', 'p99')} "
            f"| {_dist(s.e2e_ms, 'median', 'p90', 'p99')} |"
        )
    return "\n".join(lines)


def markdown(report: BenchReport, command: str | None = None, images: Sequence[str] = ()) -> str:
    """The summary: setup, notes per run, the table, then ``images`` (relative paths)."""
    config, server, machine = report.config, report.server, report.machine
    spec = config.dataset
    parts = [f"# pdserve bench: {spec.name} against {server['base_url']}", ""]
    if command:
        parts += [f"`{command}`", ""]
    parts += [
        f"- created: {report.created}",
        f"- client machine: {machine['cpu']}, {machine['cpu_count']} cores; "
        f"{machine['platform']}; Python {machine['python']}",
        f"- model: {server['model']} (max_model_len {server['max_model_len']})",
        f"- dataset: {spec.name}, {spec.num_requests} requests; SLO: {config.slo}",
    ]
    if config.priorities is not None:
        parts.append(f"- priority classes (priority:weight): {config.priorities}")
    for run in report.runs:
        s = run.summary
        extra = [*run.notes]
        if run.server_prefix_hit_rate is not None:
            extra.append(f"server prefix-cache hit rate {run.server_prefix_hit_rate:.1%}")
        if s.failed or s.wrong_length or run.not_sent:
            extra.append(
                f"{s.failed} failed, {s.wrong_length} with a wrong output length (not in "
                f"goodput), {run.not_sent} not sent"
            )
        if not s.exact_counts:
            extra.append("the server sent no token ids: ITL is per chunk, not per token")
        if run.load.max_concurrency:
            extra.append(
                f"at most {run.load.max_concurrency} in flight: latencies count from when a "
                "slot freed, not from the schedule (as vLLM's bench)"
            )
        if extra:
            parts.append(f"- {run.label}: " + "; ".join(extra))
    parts += ["", summary_table(report), ""]
    parts += [ITL_DEFINITION, ""]
    if report.runs and report.runs[0].by_priority:
        parts += ["By priority class (lower first where the server schedules by it):", "",
                  priority_table(report), ""]  # fmt: skip
    for image in images:
        parts += [f"![{Path(image).stem}]({image})", ""]
    return "\n".join(parts).rstrip() + "\n"


def write_report(
    report: BenchReport, out_dir: Path, name: str, command: str | None = None, plots: bool = True
) -> list[Path]:
    """``<name>.json``, ``<name>.md`` and (with ``plots``) the PNGs; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    body = report_dict(report)
    if command:
        body["command"] = command
    json_path.write_text(json.dumps(body, indent=1, allow_nan=False) + "\n")
    images = []
    if plots:
        from benchmarks.loadgen.plots import plot_latency_cdfs, plot_sweep

        images.append(plot_latency_cdfs(report, out_dir / f"{name}_cdf.png"))
        if len(report.runs) > 1:
            images.append(plot_sweep(report, out_dir / f"{name}_sweep.png"))
    md_path.write_text(markdown(report, command, [p.name for p in images]))
    return [json_path, md_path, *images]
