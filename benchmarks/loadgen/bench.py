"""A benchmark: one dataset offered under one or more loads (a sweep), each run summarized.

Run i of a sweep uses token seed ``seed + i``: every run sends the same shapes (lengths,
prefix structure, arrival pattern, all from ``seed``) with different token ids, so no run
is served from the prefix cache another run filled. (The shapes came from ``seed + i``
too: each point of a latency-vs-rate curve had its own workload, ±6% of prompt tokens
in a stored record; an audit.) Before the first run, ``warmup_requests`` short
requests (not measured) wake the server's lazily built state.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.loadgen.arrivals import LoadSpec
from benchmarks.loadgen.client import BenchClient, RequestResult
from benchmarks.loadgen.datasets import DatasetSpec, build_workload
from benchmarks.loadgen.metrics import SLO, Summary, summarize, window_s
from benchmarks.loadgen.priorities import PriorityMix
from benchmarks.loadgen.runner import run_load
from benchmarks.loadgen.tokens import DEFAULT_VOCAB_SIZE, TokenSource
from benchmarks.records import cpu_model
from common.prometheus_text import sample_totals


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str  # the OpenAI base URL, e.g. http://127.0.0.1:8000/v1
    dataset: DatasetSpec
    loads: tuple[LoadSpec, ...]
    slo: SLO = field(default_factory=SLO)
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0
    warmup_requests: int = 1
    timeout_s: float = 600.0
    temperature: float = 0.0
    progress: bool = True
    priorities: PriorityMix | None = None  # None: requests carry no priority

    def __post_init__(self) -> None:
        if not self.loads:
            raise ValueError("a benchmark needs at least one load")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests must be >= 0")


@dataclass(slots=True)
class RunReport:
    label: str
    load: LoadSpec
    seed: int
    summary: Summary
    results: list[RequestResult]
    not_sent: int  # requests of the workload never sent (duration bound, failed sessions)
    notes: tuple[str, ...] = ()
    # The server's own prefix-cache hit rate over the run (prompt tokens), from the
    # vLLM-named counters at /metrics; None when the server exports none.
    server_prefix_hit_rate: float | None = None
    # With a priority mix: the same summary per class, smallest priority value first.
    by_priority: dict[int, Summary] = field(default_factory=dict)


@dataclass(slots=True)
class BenchReport:
    config: BenchConfig
    server: dict[str, Any]
    runs: list[RunReport] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())


def machine_info() -> dict[str, Any]:
    """Where the client ran (the server may be elsewhere)."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_model() or platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def normalize_base_url(url: str) -> str:
    """``http://host:port`` → ``http://host:port/v1``; a URL with a path is kept."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def server_info(base_url: str, api_key: str | None, model: str | None) -> dict[str, Any]:
    """The served model (``model``, else the first listed) and its context limit, if
    the server reports one (vLLM and pdserve put ``max_model_len`` on each model)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"{base_url}/models", headers=headers, timeout=30)
    reply.raise_for_status()
    models = reply.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model")
    chosen = next((m for m in models if m.get("id") == model), None) if model else models[0]
    if chosen is None:
        raise RuntimeError(f"the server does not serve {model!r}: {[m.get('id') for m in models]}")
    return {
        "base_url": base_url,
        "model": chosen["id"],
        "max_model_len": chosen.get("max_model_len"),
    }


_PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def prefix_counters(base_url: str) -> tuple[float, float] | None:
    """(prompt tokens looked up, tokens found cached) so far, summed over label sets."""
    root = base_url.removesuffix("/v1")
    try:
        text = httpx.get(f"{root}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    totals = sample_totals(text, _PREFIX_COUNTERS)
    if not totals:
        return None
    return totals.get(_PREFIX_COUNTERS[0], 0.0), totals.get(_PREFIX_COUNTERS[1], 0.0)


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


async def warm_up(client: BenchClient, tokens: TokenSource, count: int) -> None:
    rng = tokens.stream(0xFFFF)
    for _ in range(count):
        result = RequestResult(-1, 0, 16, 4, 0.0)
        await client.send(result, list(tokens.draw(rng, 16)), time.perf_counter())
        if not result.ok:
            raise RuntimeError(f"warm-up request failed: {result.error}")


async def run_benchmark(config: BenchConfig) -> BenchReport:
    base_url = normalize_base_url(config.base_url)
    server = server_info(base_url, config.api_key, config.model)
    config = dataclasses.replace(config, base_url=base_url)
    report = BenchReport(config, server)
    async with BenchClient(
        base_url, server["model"], config.api_key, config.timeout_s, config.temperature
    ) as client:
        await warm_up(client, TokenSource(config.vocab_size, config.seed), config.warmup_requests)
        for index, load in enumerate(config.loads):
            seed = config.seed + index
            tokens = TokenSource(config.vocab_size, seed, shape_seed=config.seed)
            workload = build_workload(config.dataset, tokens, server["max_model_len"])
            before = prefix_counters(base_url)
            # (arrivals from the base seed too: the same pattern, scaled to each rate)
            results = await run_load(client, workload, load, tokens, config.seed,
                                     config.progress, config.priorities)  # fmt: skip
            results.sort(key=lambda r: r.start_s)
            by_priority = {}
            if config.priorities is not None:
                for priority in sorted({r.priority for r in results if r.priority is not None}):
                    chosen = [r for r in results if r.priority == priority]
                    by_priority[priority] = summarize(chosen, config.slo, window_s(results))
            report.runs.append(
                RunReport(
                    load.label,
                    load,
                    seed,
                    summarize(results, config.slo),
                    results,
                    workload.num_requests - len(results),
                    workload.notes,
                    hit_rate(before, prefix_counters(base_url)),
                    by_priority,
                )
            )
    return report
