"""benchmarks/fp8_load.py runs end to end on tiny settings and writes its record, for an FP8
and a packed-integer scheme."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import run_benchmark


@pytest.mark.parametrize(("scheme", "name", "max_file_ratio"),
                         [("fp8-block", "fp8_load", 0.6), ("gptq", "int_load", 0.45)])  # fmt: skip
def test_the_load_benchmark_runs_and_records(tmp_path, scheme, name, max_file_ratio):
    args = ["--size", "tiny", "--rounds", "1", "--scheme", scheme, "--tag", "smoke",
            "--out-dir", str(tmp_path)]  # fmt: skip
    run_benchmark("fp8_load", *args)
    record = json.loads((tmp_path / f"{name}_smoke.json").read_text())
    ratios = record["quantized_vs_original"]
    # float32 files against 1 byte (or half a byte) per projection weight (embeddings and
    # head kept); held as the model dtype either way
    assert ratios["file_bytes"] < max_file_ratio and ratios["held_bytes"] == 1.0
    assert record["quantized_weights"] > 0 and ratios["load_s"] > 0
    assert f"| {scheme} |" in (tmp_path / f"{name}_smoke.md").read_text()
