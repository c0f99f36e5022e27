"""PNG plots of a report: latency CDFs per run, and a sweep's throughput, goodput and tail
latencies against the offered load. Headless (matplotlib's Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from benchmarks.loadgen.bench import BenchReport
from benchmarks.loadgen.metrics import latency_samples_s


def _ecdf(ax: plt.Axes, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(report: BenchReport, path: Path) -> Path:
    """TTFT, TPOT, ITL and E2E empirical CDFs, one line per run."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("TTFT", axes[0][0]), ("TPOT", axes[0][1]), ("ITL", axes[1][0]), ("E2E", axes[1][1]))
    for run in report.runs:
        samples = latency_samples_s([r for r in run.results if r.ok])
        for name, ax in panels:
            _ecdf(ax, [value * 1000 for value in samples[name.lower()]], run.label)
    for name, ax in panels:
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("tokens" if name == "ITL" else "requests"))
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.config.dataset.name}: latency CDFs ({report.server['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def sweep_axis(report: BenchReport) -> tuple[list[float], str]:
    """x values of a sweep: the offered rate, else the concurrency, else the run index."""
    loads = [run.load for run in report.runs]
    if all(not load.closed_loop and math.isfinite(load.rate) for load in loads):
        return [load.rate for load in loads], "offered rate (sessions/s)"
    if all(load.closed_loop for load in loads):
        return [float(load.concurrency or 0) for load in loads], "concurrency"
    return [float(i) for i in range(len(loads))], "run"


def plot_sweep(report: BenchReport, path: Path) -> Path:
    """Left: request throughput and goodput against the load; right: p99 TTFT and ITL."""
    xs, xlabel = sweep_axis(report)
    summaries = [run.summary for run in report.runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(xs, [s.request_throughput for s in summaries], "o-", label="throughput")
    if all(s.goodput is not None for s in summaries):
        left.plot(xs, [s.goodput for s in summaries], "s-", label=f"goodput ({report.config.slo})")
    # Sessions/s equal requests/s only with one request per session: multi-turn sends
    # several per session, so the nominal line would sit on the wrong scale.
    if xlabel.startswith("offered rate") and report.config.dataset.name != "multi-turn":
        left.plot(xs, xs, ":", color="gray", label="offered (nominal)")
        left.plot(xs, [s.send_rate for s in summaries], "x", color="gray", label="sent")
    left.set_xlabel(xlabel)
    left.set_ylabel("requests/s")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.plot(xs, [_nan(s.ttft_ms.p99) for s in summaries], "o-", label="p99 TTFT")
    right.plot(xs, [_nan(s.itl_ms.p99) for s in summaries], "s-", label="p99 ITL")
    right.set_xlabel(xlabel)
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, which="both")
    fig.suptitle(f"{report.config.dataset.name}: load sweep ({report.server['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
