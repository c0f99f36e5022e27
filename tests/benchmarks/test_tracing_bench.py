"""benchmarks/tracing.py runs a real router with tracing off and on, side by side, and the
router's spans reach the benchmark's OTLP sink only when on."""

from __future__ import annotations

import json

from benchmarks import tracing


def test_the_tracing_benchmark_runs_both_ways_and_records(tmp_path):
    argv = ["--streams", "4", "--tokens", "8", "--rounds", "1", "--step-ms", "2",
            "--repeats", "1", "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    assert tracing.main(argv) == 0
    record = json.loads((tmp_path / "tracing_smoke.json").read_text())
    assert [row["tracing"] for row in record["rounds"]] == [False, True]
    assert all(row["tokens"] == 4 * 8 for row in record["rounds"])
    # On, the router exported its spans (the last of them at its stop): 1 warm-up + 4.
    assert record["sink"]["exports"] >= 1 and record["sink"]["bytes"] > 5 * 100
    assert "| 2 ms |" in (tmp_path / "tracing_smoke.md").read_text()
