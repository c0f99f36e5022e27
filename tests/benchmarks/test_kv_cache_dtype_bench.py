"""benchmarks/kv_cache_dtype.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

from tests.support.processes import run_benchmark


def test_the_kv_cache_dtype_benchmark_runs_and_records(tmp_path):
    args = ["--size", "tiny", "--num-prompts", "6", "--prompt-len", "48", "--output-len", "6",
            "--fits", "2", "--tag", "smoke", "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("kv_cache_dtype", *args)
    record = json.loads((tmp_path / "kv_cache_dtype_smoke.json").read_text())
    auto, fp8 = record["runs"]
    assert (auto["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "fp8")
    assert fp8["kv_bytes_per_token"] * 4 == auto["kv_bytes_per_token"]  # float32 on a CPU
    assert fp8["most_running"] > auto["most_running"] == 2  # the pool holds 2 in float32
    assert "| kv_cache_dtype |" in (tmp_path / "kv_cache_dtype_smoke.md").read_text()
