"""benchmarks/gc_pauses.py runs both heaps on a few requests and writes its record."""

from __future__ import annotations

import json

from benchmarks import gc_pauses


def test_the_gc_pauses_benchmark_runs_and_records(tmp_path):
    argv = ["--requests", "20", "--rounds", "1", "--tag", "smoke", "--out-dir", str(tmp_path)]
    assert gc_pauses.main(argv) == 0
    record = json.loads((tmp_path / "gc_pauses_smoke.json").read_text())
    assert [row["mode"] for row in record["rows"]] == ["none", "freeze"]
    assert all(row["tracked_at_start"] > 100_000 and row["wall_s"] > 0 for row in record["rows"])
    assert "| 0 | freeze |" in (tmp_path / "gc_pauses_smoke.md").read_text()
