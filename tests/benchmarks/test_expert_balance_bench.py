"""benchmarks/expert_balance.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_expert_balance_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--num-prompts", "3", "--output-len", "6", "--interval", "2",
            "--repeats", "1", "--windows", "2", "--seeds", "1", "--window-tokens", "512",
            "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("expert_balance", *args)
    record = json.loads((tmp_path / "expert_balance_smoke.json").read_text())
    cost = record["cost"]
    assert cost["num_rebalances"] > 0 and cost["rebalance_ms_median"] > 0
    assert len(record["balance"]) == 12  # (8, 32 ranks) x (0, 32 copies) x 3 skews
    hot = [row for row in record["balance"] if row["skew"] == 1.0 and row["redundant"]]
    assert all(row["previous window"] < row["loaded"] for row in hot)
    assert "| 32 | 32 | 1.0 | 512 |" in (tmp_path / "expert_balance_smoke.md").read_text()
