"""What the deployment must serve: requests' shapes and how often they come. Torch-free.

A ``Demand`` is an arrival rate and the shapes of the requests arriving (each equally
likely): from flags (one shape), from a window of a trace (its requests,
``planner/traces.py``), or from what a router served lately (``router/live_plan.py``). The
sizing reads nothing else, so all three are sized the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One request: ``isl`` prompt tokens of which ``uncached_tokens`` must be computed (the
    rest are a cached prefix), ``osl`` tokens generated."""

    isl: int
    uncached_tokens: int
    osl: int

    def __post_init__(self) -> None:
        if not 1 <= self.uncached_tokens <= self.isl:
            raise ValueError(f"uncached_tokens must be in [1, isl={self.isl}], "
                             f"got {self.uncached_tokens}")  # fmt: skip
        if self.osl < 1:
            raise ValueError(f"osl must be >= 1, got {self.osl}")


@dataclass(frozen=True, slots=True)
class Demand:
    """``rate_per_s`` requests a second, drawn from ``shapes``. ``start_s``: where this
    window starts in its trace (0 for a steady load)."""

    rate_per_s: float
    shapes: tuple[RequestShape, ...]
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.rate_per_s) or self.rate_per_s < 0:
            raise ValueError(f"rate must be a finite number >= 0, got {self.rate_per_s}")
        if not self.shapes:
            raise ValueError("a demand needs at least one request shape")


@dataclass(frozen=True, slots=True)
class TimedRequest:
    arrival_s: float
    shape: RequestShape


def windows(requests: list[TimedRequest], window_s: float) -> list[Demand]:
    """The trace cut into ``window_s`` windows, each its own demand (its requests over
    ``window_s``). A trace shorter than one window is one window as long as the trace (at
    least a second). The last of several windows is a whole one too: a trace ends at an
    arrival, so its tail's few requests over the time to the last of them read as a burst
    (a steady 1/s read 2/s in a 2 s tail, and that window sized the layout; 6 of 122 cuts
    of the Mooncake trace made their tail the busiest window, at up to 2.4x the true
    peak). Empty windows are left out."""
    if not window_s > 0:
        raise ValueError(f"window must be > 0 seconds, got {window_s}")
    end_s = max(r.arrival_s for r in requests)
    num_windows = max(1, math.ceil(end_s / window_s)) if end_s > 0 else 1
    buckets: list[list[RequestShape]] = [[] for _ in range(num_windows)]
    for request in requests:
        buckets[min(int(request.arrival_s // window_s), num_windows - 1)].append(request.shape)
    demands = []
    for i, shapes in enumerate(buckets):
        if not shapes:
            continue
        start_s = i * window_s
        length_s = window_s if num_windows > 1 else max(end_s, 1.0)
        demands.append(Demand(len(shapes) / length_s, tuple(shapes), start_s))
    return demands
