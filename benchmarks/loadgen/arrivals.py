"""When sessions start.

Open loop (the load does not wait for the server):
* ``rate`` r with ``burstiness`` b: gaps between starts are Gamma(shape=b, scale=1/(r*b)),
  mean 1/r. b = 1 is a Poisson process; b < 1 is burstier, b > 1 more regular.
  r = inf sends everything at once.
* trace replay: the trace's own arrival times, multiplied by ``time_scale``; or, when a
  rate is given, scaled so that the mean rate is r (the trace's burst pattern is kept).

Closed loop: ``concurrency`` c keeps c sessions in flight; a finished one is replaced at
once. Start times do not exist then; the runner pulls sessions as slots free up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How one run offers load, and when it stops issuing requests."""

    rate: float = math.inf  # sessions per second (open loop)
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop when set
    replay: bool = False  # trace datasets: use the trace's arrival times
    time_scale: float = 1.0  # replay without a rate: multiply trace times by this
    duration_s: float | None = None  # stop issuing new requests after this long
    max_concurrency: int | None = None  # open loop: at most this many requests in flight

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        if self.replay and math.isinf(self.rate):
            return f"trace x{1 / self.time_scale:g}"
        return f"rate={self.rate:g}" + ("" if self.burstiness == 1.0 else f",b={self.burstiness:g}")


def gamma_starts(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start times (s, the first at 0) of ``count`` sessions with Gamma-distributed gaps."""
    if count == 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng([seed, 0xA11])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def trace_starts(
    arrivals_s: list[float], rate: float = math.inf, time_scale: float = 1.0
) -> list[float]:
    """Trace arrival times from 0. With a finite ``rate``, stretched or compressed so that
    ``(count - 1) / span == rate``; otherwise multiplied by ``time_scale``."""
    if not arrivals_s:
        return []
    first = min(arrivals_s)
    times = [t - first for t in arrivals_s]
    span = max(times)
    if math.isinf(rate):
        return [t * time_scale for t in times]
    if span == 0:
        return times
    factor = (len(times) - 1) / (span * rate)
    return [t * factor for t in times]


def session_starts(
    load: LoadSpec, count: int, trace_arrivals: list[float] | None, seed: int
) -> list[float]:
    """Open-loop start times for ``count`` sessions (``trace_arrivals`` used if replaying)."""
    assert not load.closed_loop, "closed-loop runs have no start times"
    if load.replay:
        if trace_arrivals is None:
            raise ValueError("replay needs a dataset with arrival times (mooncake, azure)")
        return trace_starts(trace_arrivals, load.rate, load.time_scale)
    return gamma_starts(count, load.rate, load.burstiness, seed)
