"""benchmarks/host_batch.py runs on small shapes, in this process, and writes its record."""

from __future__ import annotations

import json

from benchmarks import host_batch


def test_the_host_batch_benchmark_runs_and_records(tmp_path):
    argv = ["--batch", "4", "--context", "40", "100", "--steps", "20", "--tag", "smoke",
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert host_batch.main(argv) == 0  # it raises if the two tables ever differ
    record = json.loads((tmp_path / "host_batch_smoke.json").read_text())
    assert [(row["batch"], row["context"]) for row in record["rows"]] == [(4, 40), (4, 100)]
    assert all(row["lists_ms"] > 0 and row["persistent_ms"] > 0 for row in record["rows"])
    assert "| 4 | 100 |" in (tmp_path / "host_batch_smoke.md").read_text()
