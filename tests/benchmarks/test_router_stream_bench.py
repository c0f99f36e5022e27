"""benchmarks/router_stream.py streams through a real router and its costless decode
worker, and writes its record."""

from __future__ import annotations

import json

from benchmarks import router_stream


def test_the_router_stream_benchmark_runs_and_records(tmp_path):
    argv = ["--streams", "4", "--tokens", "24", "--rounds", "1", "--step-ms", "2",
            "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    assert router_stream.main(argv) == 0
    record = json.loads((tmp_path / "router_stream_smoke.json").read_text())
    (row,) = record["rounds"]
    assert row["step_ms"] == 2.0 and row["tokens"] == 4 * 24
    assert row["router_cpu_us_per_token"] > 0 and 0 < row["chunks_per_token"] <= 1
    assert row["stream_max_s"] >= 24 * 2e-3  # no faster than the worker's steps
    assert (
        "| a step every 2 ms (2,000 tokens/s made) | now |"
        in (tmp_path / "router_stream_smoke.md").read_text()
    )
