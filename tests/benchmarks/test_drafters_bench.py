"""benchmarks/draft_model.py and benchmarks/eagle3.py (both ``benchmarks/drafters.py``'s
run) run end to end on tiny settings and write their records; each oracle keeps every
draft in fewer steps."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import run_benchmark


@pytest.mark.parametrize(
    ("name", "cases", "oracle_row"),
    [
        ("draft_model", ["oracle: 1 layer of the target k=2", "random: llama tiny k=2"],
         "| oracle: 1 layer of the target | 2 | 1.00 |"),
        ("eagle3", ["oracle k=2", "random (512 draft ids) k=2"], "| oracle | 2 | 1.00 |"),
    ],
)  # fmt: skip
def test_the_drafting_benchmark_runs_and_records(tmp_path, name, cases, oracle_row):
    args = ["--size", "tiny", "--requests", "3", "--batch", "3", "--prompt-tokens", "20",
            "--max-tokens", "9", "--k", "2", "--repeats", "1", "--tag", "smoke",
            "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark(name, *args)
    record = json.loads((tmp_path / f"{name}_smoke.json").read_text())
    assert [row["case"] for row in record["rows"]] == ["no drafts", *cases]
    oracle = record["rows"][1]
    assert oracle["acceptance"] == 1.0 and oracle["steps"] < record["rows"][0]["steps"]
    assert oracle_row in (tmp_path / f"{name}_smoke.md").read_text()
