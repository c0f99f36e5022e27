"""benchmarks/sampler.py runs on tiny shapes, in this process, and writes its record."""

from __future__ import annotations

import json

from benchmarks import sampler


def test_the_sampler_benchmark_runs_and_records(tmp_path):
    argv = ["--batch", "3", "--vocab", "1500", "--repeats", "1", "--tag", "smoke",
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert sampler.main(argv) == 0  # 0 only if both samplers chose the same tokens
    record = json.loads((tmp_path / "sampler_smoke.json").read_text())
    assert len(record["rows"]) == 2 * len(sampler.SETTINGS)  # zipf and normal logits
    assert all(row["same_tokens"] and row["batched_ms"] > 0 for row in record["rows"])
    table = (tmp_path / "sampler_smoke.md").read_text()
    assert table.count("| zipf | 3 |") == len(sampler.SETTINGS)
