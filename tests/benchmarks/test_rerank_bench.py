"""benchmarks/rerank.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_rerank_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--num-documents", "4", "--repeats", "1"]
    run_benchmark("rerank", *args, "--out-dir", str(tmp_path), "--tag", "t")
    record = json.loads((tmp_path / "rerank_t.json").read_text())
    baseline, cold, warm = record["rows"]
    assert baseline["case"] == "transformers forward (baseline)" and baseline["vs_baseline"] == 1.0
    assert record["max_abs_diff"] < 1e-4  # the engine's scores are transformers'
    total = 4 * record["prompt_len"]
    assert cold["tokens_computed"] == total  # the prefix cache off: every token
    # On: the head and query once a run, so at most one pair computes them whole.
    shared_blocks = record["shared_prefix_len"] // 16 * 16
    assert warm["tokens_computed"] <= total - 3 * shared_blocks
    assert "| engine, prefix cache on |" in (tmp_path / "rerank_t.md").read_text()
