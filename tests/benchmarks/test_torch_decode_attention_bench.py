"""benchmarks/torch_decode_attention.py runs end to end on tiny settings and writes its
record: the gathers agree (the script checks), the engine's tokens too."""

from __future__ import annotations

import json

from kernels import reference
from tests.support.processes import run_benchmark


def test_the_torch_decode_attention_benchmark_runs_and_records(tmp_path):
    gather = reference._padded_kv
    run_benchmark("torch_decode_attention", "--batch", "2", "--context", "40", "--repeats", "1",
                  "--shapes", "demo (4 q / 2 kv heads of 64)", "--engine-prompts", "2",
                  "--engine-prompt-len", "16", "--out", str(tmp_path / "r"))  # fmt: skip
    record = json.loads((tmp_path / "r.json").read_text())
    assert [(r["batch"], r["context"]) for r in record["rows"]] == [(2, 40)]
    assert record["engine"]["same_tokens"] is True
    assert reference._padded_kv is gather  # the baseline swapped back in
    assert "mean decode step" in (tmp_path / "r.md").read_text()
