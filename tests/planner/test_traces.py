"""Traces read as timed request shapes: lengths scaled and clipped, Mooncake's prefix blocks
replayed through an LRU cache."""

from __future__ import annotations

import json

import pytest

from planner.demand import RequestShape
from planner.traces import TraceOptions, azure_requests, mooncake_requests


def write_mooncake(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_mooncake_hits_are_leading_blocks_in_the_lru_cache(tmp_path):
    trace = write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1200, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [4, 1]},
    ])  # fmt: skip
    requests = mooncake_requests(trace, TraceOptions(cache_tokens=10 * 512))
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0, 1.0]
    shapes = [r.shape for r in requests]
    assert shapes[0] == RequestShape(1500, 1500, 10)
    assert shapes[1] == RequestShape(1200, 1200 - 1024, 20)  # blocks 0, 1 cached
    assert shapes[2] == RequestShape(1024, 1, 5)  # all cached but the last token
    assert shapes[3] == RequestShape(600, 600, 5)  # block 1 without 0 before it: no hit

    # A cache of three blocks: request 2's blocks (0, 1, 3) push 2 out; request 3 still
    # finds 0, 1. With two, each request's last blocks push out its first: nothing leads.
    three = mooncake_requests(trace, TraceOptions(cache_tokens=3 * 512))
    assert three[2].shape.uncached_tokens == 1
    two = mooncake_requests(trace, TraceOptions(cache_tokens=2 * 512))
    assert [r.shape.uncached_tokens for r in two] == [1500, 1200, 1024, 600]


def test_mooncake_scales_blocks_with_lengths_and_clips_to_the_context(tmp_path):
    trace = write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 3000, "output_length": 400, "hash_ids": list(range(6))},
        {"timestamp": 4000, "input_length": 3000, "output_length": 400,
         "hash_ids": [*range(5), 9]},
    ])  # fmt: skip
    options = TraceOptions(input_scale=0.1, output_scale=0.5, rate_scale=2.0,
                           max_model_len=250, cache_tokens=10_000)  # fmt: skip
    first, second = mooncake_requests(trace, options)
    assert second.arrival_s == 2.0
    # 300 prompt tokens and 200 output, clipped to 250: the output first keeps its 200.
    assert first.shape == RequestShape(50, 50, 200)
    # Five 51.2-token blocks cached (256 tokens), more than the clipped prompt: 1 computed.
    assert second.shape == RequestShape(50, 1, 200)


def test_azure_reads_lengths_and_times(tmp_path):
    trace = tmp_path / "a.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.0000000,374,44\n"
        "2023-11-16 18:15:48.5000000,100,0\n"
        "2023-11-16 18:15:50.0000000,10,5\n"
    )
    requests = azure_requests(trace, TraceOptions(num_requests=2, output_scale=2.0))
    assert [r.arrival_s for r in requests] == [0.0, 2.5]
    assert [r.shape for r in requests] == [RequestShape(374, 374, 88), RequestShape(100, 100, 1)]
    offset = azure_requests(trace, TraceOptions(offset=2))
    assert [r.shape.isl for r in offset] == [10]


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="input_scale"):
        TraceOptions(input_scale=0)
    with pytest.raises(ValueError, match="no rows"):
        mooncake_requests(write_mooncake(tmp_path / "e.jsonl", []), TraceOptions())
