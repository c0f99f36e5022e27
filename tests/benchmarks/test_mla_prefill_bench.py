"""benchmarks/mla_prefill.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_mla_prefill_benchmark_runs_and_records(tmp_path):
    args = ["--prompt-lens", "40", "90", "--num-heads", "2", "--num-layers", "1",
            "--repeats", "1", "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("mla_prefill", *args)
    record = json.loads((tmp_path / "mla_prefill_smoke.json").read_text())
    assert [row["prompt_len"] for row in record["rows"]] == [40, 90]
    for row in record["rows"]:
        assert row["same_tokens"] and row["absorbed_s"] > 0 and row["chosen_s"] > 0
    assert "| 90 |" in (tmp_path / "mla_prefill_smoke.md").read_text()
