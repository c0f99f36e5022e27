"""benchmarks/tensor_parallel.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_tensor_parallel_benchmark_runs_and_records(tmp_path):
    # 12 output tokens: the decode step is a difference of two timings, which a 3-step
    # decode left within the noise of a busy 2-core machine (negative once, 2026-11-29).
    args = ["--size", "tiny", "--num-prompts", "3", "--output-len", "12", "--tag", "smoke",
            "--latency-output-len", "8", "--max-prompt-len", "64",  # see test_moe_bench
            "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("tensor_parallel", *args)
    record = json.loads((tmp_path / "tensor_parallel_smoke.json").read_text())
    assert record["identical_sequences"] == "3/3"  # split over 2 ranks, the same tokens
    assert [run["tensor_parallel_size"] for run in record["runs"]] == [1, 2]
    assert all(value > 0 for value in record["tp2_vs_tp1"].values())
    assert "| tensor_parallel_size |" in (tmp_path / "tensor_parallel_smoke.md").read_text()
