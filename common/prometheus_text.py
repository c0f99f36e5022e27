"""Reading the router's /metrics page (Prometheus' text exposition) without a client
library: the ``pdserve up`` launcher waits on it, and the benchmarks read counters from it."""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Iterable


def fetch(metrics_url: str, timeout_s: float) -> str | None:
    """The /metrics page's text; None while it does not answer (a router starting or
    restarting)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
            return reply.read().decode()
    except (OSError, http.client.HTTPException, ValueError):  # (a reply cut off: a router
        return None  # killed mid-answer; one not UTF-8)


def sample_totals(text: str, names: Iterable[str]) -> dict[str, float]:
    """In a Prometheus text exposition, each of ``names`` (sample names, e.g.
    ``x_total`` or ``x_sum``) summed over its label sets; names with no sample are left
    out."""
    wanted = set(names)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
