"""benchmarks/images.py runs end to end on tiny settings and writes its record."""

from __future__ import annotations

import json

import pytest

from tests.support.processes import run_benchmark


@pytest.mark.parametrize("arch", ["llava", "gemma3_mm", "qwen2_5_vl"])
def test_the_images_benchmark_runs_and_records(tmp_path, arch):
    args = ["--size", "tiny", "--num-prompts", "3", "--text-tokens", "20", "--repeats", "1",
            "--arch", arch]  # fmt: skip
    run_benchmark("images", *args, "--out-dir", str(tmp_path), "--tag", "t")
    record = json.loads((tmp_path / "images_t.json").read_text())
    assert record["rows"][0]["case"].endswith("(baseline)")
    assert record["rows"][0]["vs_baseline"] == 1.0 and len(record["rows"]) == 4
    assert record["images_encoded_when_cached"] == 0  # the second turn encodes nothing
    assert "| with images, no caches |" in (tmp_path / "images_t.md").read_text()
