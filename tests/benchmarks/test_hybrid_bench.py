"""benchmarks/hybrid.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import run_benchmark


@pytest.mark.parametrize(
    ("arch", "dense"), [("qwen3_5", "qwen3"), ("granite_hybrid_dense", "granite")]
)
def test_the_hybrid_benchmark_runs_and_records(tmp_path, arch, dense):
    args = ["--arch", arch, "--size", "tiny", "--num-prompts", "2", "--prompt-tokens", "24",
            "--batch", "2", "--contexts", "16", "40", "--decode-tokens", "3", "--turn-tokens", "40",
            "--system-tokens", "32", "--repeats", "1"]  # fmt: skip
    run_benchmark("hybrid", *args, "--out-dir", str(tmp_path), "--tag", "t")
    record = json.loads((tmp_path / "hybrid_t.json").read_text())
    assert [row["model"] for row in record["rows"]] == [f"dense ({dense})", f"hybrid ({arch})"]
    assert set(record["ratios"]) == {"prefill_tokens_per_s", "decode_tokens_per_s@16",
                                     "decode_tokens_per_s@40", "next_turn_speedup",
                                     "next_turn_tier_speedup", "system_prompt_speedup@2",
                                     "system_prompt_speedup@3"}  # fmt: skip
    assert all(row["next_turn_speedup"] > 0 for row in record["rows"])
    # The next turn's 72 tokens (40 + a 32-token answer) all come back from the CPU tier
    # (the benchmark checks none stayed on the device, and the tokens).
    assert [row["next_turn_tier_hit_tokens"] for row in record["rows"]] == [64, 64]
    assert all(row["system_prompt_speedup@3"] > 0 for row in record["rows"])
    # Under a shared 32-token system prompt the dense model takes its blocks from the
    # second conversation on; the hybrid its snapshot, made by the second, from the third.
    dense_row, hybrid_row = record["rows"]
    assert [dense_row[f"system_prompt_hit_tokens@{n}"] for n in (2, 3)] == [32, 32]
    assert [hybrid_row[f"system_prompt_hit_tokens@{n}"] for n in (2, 3)] == [0, 32]
    # The hybrid's pull holds its states beside fewer layers' KV: the bytes are exact.
    pull = record["pull_bytes"][-1]
    assert pull[f"hybrid ({arch})"] < pull[f"dense ({dense})"]
    assert "| hybrid / dense |" in (tmp_path / "hybrid_t.md").read_text()
