"""Reading the router's /metrics page (Prometheus' text exposition) without a client
library: the ``pdserve up`` launcher waits on it, and the benchmarks read counters from it."""

from __future__ import annotations

from collections.abc import Iterable


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
