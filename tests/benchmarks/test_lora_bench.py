"""benchmarks/lora.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_lora_benchmark_runs_and_records(tmp_path):
    out = tmp_path / "lora.json"
    args = ["--requests", "4", "--batch", "4", "--max-tokens", "8", "--repeats", "1"]
    run_benchmark("lora", *args, "--out", str(out))
    record = json.loads(out.read_text())
    cases = [row["case"] for row in record["rows"]]
    assert cases[0] == "base model (baseline)" and "4 adapters" in cases
    assert record["rows"][0]["vs_base"] == 1.0
    assert all(row["seconds"] > 0 for row in record["rows"])
