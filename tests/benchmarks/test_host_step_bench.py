"""benchmarks/host_step.py runs on small shapes, in this process, beside a worktree of HEAD,
and writes its record."""

from __future__ import annotations

import json

from benchmarks import host_step


def test_the_host_step_benchmark_runs_and_records(tmp_path):
    argv = ["--batch", "3", "--context", "40", "100", "--steps", "4", "--before", "HEAD",
            "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    # It raises if a step returns fewer outputs than requests, or anything leaks.
    assert host_step.main(argv) == 0
    record = json.loads((tmp_path / "host_step_smoke.json").read_text())
    cases = [(row["context"], row["shape"]) for row in record["rows"]]
    assert cases == [(40, "prompt"), (40, "output"), (100, "prompt"), (100, "output")]
    assert all(row["ms"] > 0 and row["before_ms"] > 0 for row in record["rows"])
    assert "| 3 | 100 | output |" in (tmp_path / "host_step_smoke.md").read_text()
