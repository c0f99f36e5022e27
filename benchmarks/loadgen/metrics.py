"""Latency and throughput of a run, from the client's timeline of each request.

Definitions (times from when the client started sending the request):
* TTFT: arrival of the first chunk that carries a token.
* ITL: one entry per output token after the first. A chunk that carries k tokens and
  arrived g after the previous token chunk gives k entries of g/k (the router's own
  ``vllm:inter_token_latency_seconds`` records one entry of g/k per chunk instead: equal
  while pdserve streams a token per chunk); extra tokens in the first chunk give entries
  of 0. So a request's ITL entries sum to (last token - first token). A server that
  sends no token ids gives per-chunk counts only (``Summary.exact_counts`` False, said in
  the report): its ITL is then per chunk, not per token; TPOT stays exact (usage).
* TPOT: (last token - first token) / (output tokens - 1); undefined for one token. It
  is the mean of the request's ITL entries when every count is exact.
* E2E: until the stream ended (``[DONE]``), so it includes the usage chunk.
* Window: from the first request's start to the last request's end; throughputs divide
  by it. Request throughput counts completed requests; token throughput counts the
  completed requests' prompt (total only) and output tokens. The send rate is
  (requests - 1) / (last start - first start): the load really offered, which in a short
  Poisson run strays from the nominal rate.
* Goodput: completed requests with the requested output length that meet every SLO
  given, per second of the window; a one-token request has no TPOT and meets any TPOT
  SLO. Failed requests never count, nor do short ones (a server that stopped early meets
  an E2E limit easily).
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.loadgen.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency limits in ms; None: no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``"ttft=500,tpot=50"`` (ms; keys ttft, tpot, e2e) → SLO."""
        limits: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad SLO item {item!r}: use KEY=MS with KEY in {SLO_KEYS}")
            if key in limits:
                raise ValueError(f"SLO {key} given twice")
            limits[key] = float(value)
            if not limits[key] > 0:
                raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
        return cls(**{f"{k}_ms": v for k, v in limits.items()})

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok or result.output_tokens != result.expected_output_tokens:
            return False
        checks = (
            (self.ttft_ms, result.ttft_s),
            (self.tpot_ms, tpot_s(result)),
            (self.e2e_ms, result.e2e_s),
        )
        return all(
            limit is None or value is None or value * 1000 <= limit for limit, value in checks
        )

    def __str__(self) -> str:
        parts = [
            f"{k}={getattr(self, f'{k}_ms'):g}ms"
            for k in SLO_KEYS
            if getattr(self, f"{k}_ms") is not None
        ]
        return ",".join(parts) or "none"


def itl_s(result: RequestResult) -> list[float]:
    """The request's inter-token latencies (see the module docstring)."""
    times, counts = result.chunk_times_s, result.chunk_tokens
    if not times:
        return []
    gaps = [0.0] * (counts[0] - 1)
    for previous, now, count in zip(times, times[1:], counts[1:], strict=False):
        gaps.extend([(now - previous) / count] * count)
    return gaps


def tpot_s(result: RequestResult) -> float | None:
    if result.output_tokens < 2 or result.ttft_s is None or result.last_token_s is None:
        return None
    return (result.last_token_s - result.ttft_s) / (result.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Stats:
    """A distribution in ms; every field but ``count`` is None when it is empty."""

    count: int
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Stats:
        if not values_s:
            return cls(0)
        ms = np.asarray(values_s, dtype=float) * 1000
        p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
        return cls(len(ms), float(ms.mean()), p50, p90, p99, float(ms.min()), float(ms.max()))


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    completed: int
    failed: int
    wrong_length: int  # completed, but not with the requested number of tokens
    duration_s: float
    send_rate: float  # requests sent per second: (sent - 1) / (last send - first send)
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_token_throughput: float
    total_token_throughput: float
    good_requests: int | None  # None without an SLO
    goodput: float | None
    slo: str
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    exact_counts: bool = True  # False: some chunks' token counts were estimated

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def latency_samples_s(done: Sequence[RequestResult]) -> dict[str, list[float]]:
    """The values each latency metric is computed from, in seconds, for completed
    requests: ``ttft``, ``tpot`` and ``e2e`` one per request that has it, ``itl`` one
    per output token after the first. Summaries and plots both read these."""
    return {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for t in map(tpot_s, done) if t is not None],
        "itl": [gap for r in done for gap in itl_s(r)],
        "e2e": [r.e2e_s for r in done if r.e2e_s is not None],
    }


def window_s(results: Sequence[RequestResult]) -> float:
    """From the first start to the last end (0 for no finished request)."""
    ends = [r.end_s for r in results if r.end_s is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.start_s for r in results)


def send_rate(results: Sequence[RequestResult]) -> float:
    """The load actually offered, which a short open-loop run draws noisily around its
    nominal rate (0 for fewer than two requests or all sent at once)."""
    starts = [r.start_s for r in results]
    span = max(starts) - min(starts) if starts else 0.0
    return (len(starts) - 1) / span if span > 0 else 0.0


def summarize(
    results: Sequence[RequestResult], slo: SLO, duration_s: float | None = None
) -> Summary:
    """``duration_s``: the window rates are per (default: ``results``' own). A subset of
    a run (a priority class) takes the run's, so that the classes' rates add up to the
    run's: over its own window, a class of two requests 0.1 s apart had 8.3 requests/s of
    goodput in a run of 1.2 (an audit)."""
    done = [r for r in results if r.ok]
    duration = window_s(results) if duration_s is None else duration_s

    def per_s(value: float) -> float:
        return value / duration if duration > 0 else 0.0

    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = None if slo.empty else sum(slo.met_by(r) for r in done)
    samples = latency_samples_s(done)
    return Summary(
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        wrong_length=sum(r.output_tokens != r.expected_output_tokens for r in done),
        duration_s=duration,
        send_rate=send_rate(results),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=per_s(len(done)),
        output_token_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        good_requests=good,
        goodput=None if good is None else per_s(good),
        slo=str(slo),
        ttft_ms=Stats.of_seconds(samples["ttft"]),
        tpot_ms=Stats.of_seconds(samples["tpot"]),
        itl_ms=Stats.of_seconds(samples["itl"]),
        e2e_ms=Stats.of_seconds(samples["e2e"]),
        exact_counts=all(r.exact_counts for r in done),
    )
