"""benchmarks/mtp.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_mtp_benchmark_runs_and_records(tmp_path):
    args = ["--requests", "3", "--batch", "3", "--prompt-tokens", "20", "--max-tokens", "9",
            "--k", "2", "--repeats", "1", "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("mtp", *args)
    record = json.loads((tmp_path / "mtp_smoke.json").read_text())
    cases = [(row["model"], row["case"]) for row in record["rows"]]
    assert cases == [("random MTP", "no drafts"), ("random MTP", "mtp k=0 (MTP KV only)"),
                     ("random MTP", "mtp k=2"), ("oracle MTP", "no drafts"),
                     ("oracle MTP", "mtp k=2")]  # fmt: skip
    oracle = record["rows"][-1]
    assert oracle["acceptance"] == 1.0 and oracle["steps"] < record["rows"][-2]["steps"]
    assert "| oracle MTP | mtp k=2 | 1.00 |" in (tmp_path / "mtp_smoke.md").read_text()
