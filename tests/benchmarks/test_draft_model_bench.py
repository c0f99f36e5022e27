"""benchmarks/draft_model.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_draft_model_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--requests", "3", "--batch", "3", "--prompt-tokens", "20",
            "--max-tokens", "9", "--k", "2", "--repeats", "1", "--tag", "smoke",
            "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("draft_model", *args)
    record = json.loads((tmp_path / "draft_model_smoke.json").read_text())
    cases = [row["case"] for row in record["rows"]]
    assert cases == ["no drafts", "oracle: 1 layer of the target k=2", "random: llama tiny k=2"]
    oracle = record["rows"][1]
    assert oracle["acceptance"] == 1.0 and oracle["steps"] < record["rows"][0]["steps"]
    assert (
        "| oracle: 1 layer of the target | 2 | 1.00 |"
        in (tmp_path / "draft_model_smoke.md").read_text()
    )
