"""benchmarks/shared_prefix_prefill.py runs on small shapes, in this process, beside a
worktree of HEAD, and writes its record."""

from __future__ import annotations

import json

from benchmarks import shared_prefix_prefill


def test_the_shared_prefix_benchmark_runs_and_records(tmp_path):
    argv = ["--size", "tiny", "--requests", "3", "--shared", "96", "--suffix", "5",
            "--output", "2", "--chunk", "32", "--budget", "128", "--before", "HEAD",
            "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    assert shared_prefix_prefill.main(argv) == 0  # 0 only if both revisions' tokens agree
    record = json.loads((tmp_path / "shared_prefix_prefill_smoke.json").read_text())
    (row,) = record["rows"]
    # 96 shared tokens are 6 blocks of 16, computed once now.
    assert row["requests"] == 3 and row["prompt_tokens_computed"] == 96 + 3 * 5
    assert row["same_tokens"] and row["before"]["wall_s"] > 0
    assert "| 3 | 111 |" in (tmp_path / "shared_prefix_prefill_smoke.md").read_text()
