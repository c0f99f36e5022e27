"""benchmarks/fp8_load.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_fp8_load_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--rounds", "1", "--tag", "smoke", "--out-dir", str(tmp_path)]
    run_benchmark("fp8_load", *args)
    record = json.loads((tmp_path / "fp8_load_smoke.json").read_text())
    ratios = record["fp8_vs_original"]
    # float32 files against one byte per projection weight (embeddings and head kept)
    assert ratios["file_bytes"] < 0.6 and ratios["held_bytes"] == 1.0
    assert record["fp8_weights"] > 0 and ratios["load_s"] > 0
    assert "| fp8-block |" in (tmp_path / "fp8_load_smoke.md").read_text()
