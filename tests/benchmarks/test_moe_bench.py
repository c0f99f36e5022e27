"""benchmarks/moe.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_moe_benchmark_runs_and_records(tmp_path):
    # Batch-1 latency is the difference of two timed runs: over 3 tokens a loaded machine's
    # noise once made transformers' negative; 8 keep it above the noise.
    args = ["--size", "tiny", "--num-prompts", "3", "--output-len", "6",
            "--latency-output-len", "8", "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("moe", *args)
    record = json.loads((tmp_path / "moe_smoke.json").read_text())
    assert record["identical_sequences"] == 3  # the MoE engine's tokens are transformers'
    assert record["cached_prompt_tokens"] == 0  # (the warm-up's were reused: transformers' not)
    assert set(record["ratios"]) == {
        "moe_vs_dense_throughput", "moe_vs_dense_batch1",
        "moe_vs_transformers_throughput", "moe_vs_transformers_batch1",
    }  # fmt: skip
    assert all(value > 0 for value in record["ratios"].values())
    sweep = record["layer_sweep"]
    assert [row["tokens"] for row in sweep] == [1, 4, 16, 64, 512, 4096]
    assert sweep[0]["experts_hit"] == record["experts_per_token"]  # one token: k experts
    assert "| tokens | dense ms |" in (tmp_path / "moe_smoke.md").read_text()
