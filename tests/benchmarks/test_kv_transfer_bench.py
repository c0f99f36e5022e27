"""benchmarks/kv_transfer.py and benchmarks/nixl_lanes_trace.py: the rounds are combined
as documented, and both scripts run end to end on tiny settings (real processes, NIXL)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.kv_transfer import combine_rounds
from tests.support.processes import ROOT


def row(ratio: float, gbps: float, exact: bool = True) -> dict:
    return {
        "connector": "nixl",
        "block_order": "random",
        "size_mb": 16,
        "median_s": 16e6 / gbps / 1e9,
        "gbps": gbps,
        "best_gbps": gbps * 1.1,
        "memcpy_gbps": gbps / ratio,
        "memcpy_hot_gbps": 20.0,
        "ratio": ratio,
        "ratio_hot": gbps / 20.0,
        "bit_exact": exact,
    }


def test_combine_rounds_takes_medians_and_keeps_the_range():
    rounds = [[row(0.6, 6.0)], [row(0.9, 9.0)], [row(0.75, 8.0, exact=False)]]
    (combined,) = combine_rounds(rounds)
    assert combined["ratio"] == 0.75  # median of the rounds' ratios
    assert combined["gbps"] == 8.0
    assert combined["best_gbps"] == pytest.approx(9.9)  # the best of any round
    assert combined["ratios"] == [0.6, 0.9, 0.75]
    assert combined["bit_exact"] is False  # one inexact round makes the row inexact


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_kv_transfer_benchmark_runs_rounds_and_writes_the_record(tmp_path):
    out = tmp_path / "kv"
    result = run(
        "kv_transfer.py", "--connectors", "nixl", "--sizes-mb", "1", "--orders", "random",
        "--repeats", "1", "--warmup", "0", "--rounds", "2", "--num-blocks", "64",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("round ") == 2
    record = out.with_suffix(".md").read_text()
    assert "| ratio range |" in record
    assert "| nixl | random | 1 |" in record
    assert record.count("| True |") == 1  # bit-exact


@pytest.mark.timeout(300)
def test_lanes_trace_runs_and_reports(tmp_path):
    result = run("nixl_lanes_trace.py", "--size-mb", "4", "--fetches", "3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "median" in result.stdout and "GB/s over 3" in result.stdout
    assert "threads still alive" not in result.stdout
