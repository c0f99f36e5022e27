"""benchmarks/embeddings.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_embeddings_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--num-prompts", "4", "--prompt-len", "24", "--repeats", "1"]
    run_benchmark("embeddings", *args, "--out-dir", str(tmp_path), "--tag", "t")
    record = json.loads((tmp_path / "embeddings_t.json").read_text())
    cases = [row["case"] for row in record["rows"]]
    assert cases[0] == "transformers forward (baseline)" and len(cases) == 4
    assert record["rows"][0]["vs_baseline"] == 1.0 and record["max_abs_diff"] < 1e-4
    assert all(row["seconds"] > 0 for row in record["rows"])
    assert "| engine embed |" in (tmp_path / "embeddings_t.md").read_text()
