"""benchmarks/priority.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_priority_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--num-requests", "8", "--max-prompt-len", "64",
            "--min-output-len", "4", "--max-output-len", "12", "--max-num-seqs", "2",
            "--rounds", "1", "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("priority", *args)
    record = json.loads((tmp_path / "priority_smoke.json").read_text())
    fcfs, priority = record["runs"]
    assert (fcfs["policy"], priority["policy"]) == ("fcfs", "priority")
    assert fcfs["preemptions"] == 0  # FCFS never preempts to admit; the pool is ample
    assert record["identical_sequences"] == "8/8" and record["rounds"] == 1
    for run in record["runs"]:
        classes = run["classes"]
        assert classes["interactive"]["num_requests"] + classes["batch"]["num_requests"] == 8
        assert classes["all"]["num_requests"] == 8
        assert all(c["ttft_p50_s"] <= c["e2e_p50_s"] for c in classes.values())
    assert "| policy | class |" in (tmp_path / "priority_smoke.md").read_text()
