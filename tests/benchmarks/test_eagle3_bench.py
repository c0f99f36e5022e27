"""benchmarks/eagle3.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_eagle3_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--requests", "3", "--batch", "3", "--prompt-tokens", "20",
            "--max-tokens", "9", "--k", "2", "--repeats", "1", "--tag", "smoke",
            "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("eagle3", *args)
    record = json.loads((tmp_path / "eagle3_smoke.json").read_text())
    cases = [row["case"] for row in record["rows"]]
    assert cases == ["no drafts", "oracle k=2", "random (512 draft ids) k=2"]
    oracle = record["rows"][1]
    assert oracle["acceptance"] == 1.0 and oracle["steps"] < record["rows"][0]["steps"]
    assert "| oracle | 2 | 1.00 |" in (tmp_path / "eagle3_smoke.md").read_text()
