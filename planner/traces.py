"""Mooncake and Azure traces read as timed request shapes, for ``pdserve plan size``.

Only lengths, arrivals and Mooncake's prefix block ids are read; the loaders in
``benchmarks/loadgen/traces.py`` build prompts from the same files for replaying them.
"""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from benchmarks.loadgen.traces import (
    MOONCAKE_BLOCK_TOKENS,
    jsonl_rows,
    parse_azure_time,
    scaled_length,
)
from planner.demand import RequestShape, TimedRequest


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """How a trace is read. Lengths are multiplied by the scales (a small model's context
    is short) and clipped so that prompt + output fit ``max_model_len``; arrival times are
    divided by ``rate_scale`` (2: the same traffic twice as fast). ``cache_tokens``: the
    prefix cache Mooncake's block ids are replayed through (least recently used)."""

    num_requests: int | None = None
    offset: int = 0
    input_scale: float = 1.0
    output_scale: float = 1.0
    rate_scale: float = 1.0
    max_model_len: int | None = None
    cache_tokens: int = 0

    def __post_init__(self) -> None:
        for key in ("input_scale", "output_scale", "rate_scale"):
            value = getattr(self, key)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{key} must be a finite number > 0, got {value}")
        if self.offset < 0 or self.cache_tokens < 0:
            raise ValueError("offset and cache_tokens must be >= 0")


def _shape(isl: int, cached: int, osl: int, options: TraceOptions) -> RequestShape:
    """Clipped to fit ``max_model_len`` (the output first: it is what the decode side is
    sized by); the prompt's last token is always computed."""
    if options.max_model_len is not None:
        osl = min(osl, options.max_model_len - 1)
        isl = min(isl, options.max_model_len - osl)
    return RequestShape(isl, isl - min(cached, isl - 1), osl)


def mooncake_requests(path: Path, options: TraceOptions) -> list[TimedRequest]:
    """Mooncake rows as requests. Each ``hash_ids`` entry is a 512-token block whose id
    includes its prefix, so a request's cached part is its leading ids already in an LRU
    cache of ``cache_tokens`` (every request's blocks enter it): the hits a prefix-aware
    router would find on one worker's cache of that size. The last prompt token is always
    computed."""
    block_tokens = MOONCAKE_BLOCK_TOKENS * options.input_scale
    capacity_blocks = int(options.cache_tokens // block_tokens)
    cache: OrderedDict[int, None] = OrderedDict()
    requests = []
    for row in jsonl_rows(path, options.offset, options.num_requests):
        isl = scaled_length(row["input_length"], options.input_scale)
        hits = 0
        for block_id in row["hash_ids"]:
            if block_id not in cache:
                break
            hits += 1
        for block_id in row["hash_ids"]:
            cache[block_id] = None
            cache.move_to_end(block_id)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
        osl = scaled_length(row["output_length"], options.output_scale)
        arrival_s = row["timestamp"] / 1000 / options.rate_scale
        shape = _shape(isl, int(hits * block_tokens), osl, options)
        requests.append(TimedRequest(arrival_s, shape))
    return _from_zero(requests)


def azure_requests(path: Path, options: TraceOptions) -> list[TimedRequest]:
    """Azure LLM 2023 rows as requests: lengths and arrivals only (no prefix
    information, so nothing is cached)."""
    requests = []
    with path.open(newline="") as f:
        for row in _window(csv.DictReader(f), options):
            isl = scaled_length(int(row["ContextTokens"]), options.input_scale)
            osl = scaled_length(int(row["GeneratedTokens"]), options.output_scale)
            arrival_s = parse_azure_time(row["TIMESTAMP"]) / options.rate_scale
            requests.append(TimedRequest(arrival_s, _shape(isl, 0, osl, options)))
    return _from_zero(requests)


def _window(rows: Iterable[dict], options: TraceOptions) -> Iterator[dict]:
    end = None if options.num_requests is None else options.offset + options.num_requests
    return islice(rows, options.offset, end)


def _from_zero(requests: list[TimedRequest]) -> list[TimedRequest]:
    if not requests:
        raise ValueError("the trace has no rows in the range asked for")
    first = min(r.arrival_s for r in requests)
    return [TimedRequest(r.arrival_s - first, r.shape) for r in requests]
