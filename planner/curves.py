"""A profile's points as functions: prefill speed by prompt length, decode step time by
batch and context. Torch-free.

Between points both are linear. Beyond them each grows as its cost does: a prompt's
per-token time grows linearly with its length (attention reads every earlier token), and a
decode step's time grows linearly with batch and with context (each request reads its own
KV). So the last segment is extended where it rises; the sizing says when its answer
leans on that (``max_isl``, ``max_batch_at``, ``max_context``).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

from planner.profile_data import DecodePoint, PrefillPoint


def _linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing). Below ``xs[0]``: ``ys[0]``. Above
    ``xs[-1]``: the last segment extended if it rises, else ``ys[-1]`` (a cost measured
    falling with size, as fixed costs amortize, is not extended into a fall)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    i = min(bisect.bisect_right(xs, x) - 1, len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    slope = (y1 - y0) / (x1 - x0)
    if x > x1:
        return y1 + max(slope, 0.0) * (x - x1)
    return y0 + slope * (x - x0)


class PrefillCurve:
    """Prefill speed by prompt length, from points of distinct ``isl``."""

    def __init__(self, points: Sequence[PrefillPoint]) -> None:
        ordered = sorted(points, key=lambda p: p.isl)
        self.isls = [p.isl for p in ordered]
        if len(set(self.isls)) != len(self.isls):
            raise ValueError(f"prefill points repeat a prompt length: {self.isls}")
        self._token_s = [1.0 / p.tokens_per_s for p in ordered]
        self._latency_s = [p.latency_s for p in ordered]
        self.max_isl = self.isls[-1]

    def token_s(self, isl: float) -> float:
        """Seconds of a busy worker per prompt token computed, for prompts of ``isl`` tokens.
        Below the shortest point: that point's (fixed costs dominate short prompts)."""
        return _linear(self.isls, self._token_s, isl)

    def latency_s(self, isl: float) -> float:
        """One prompt of ``isl`` tokens alone, arrival to first token."""
        return _linear(self.isls, self._latency_s, isl)


class DecodeCurve:
    """Decode step time by batch and mean context, from points on a grid: every context
    measured at the same batches (``planner/profiler.py`` measures them so)."""

    def __init__(self, points: Sequence[DecodePoint]) -> None:
        by_context: dict[int, list[DecodePoint]] = defaultdict(list)
        for point in points:
            by_context[point.context_tokens].append(point)
        self.contexts = sorted(by_context)
        self._rows: list[tuple[list[int], list[float]]] = []
        for context in self.contexts:
            row = sorted(by_context[context], key=lambda p: p.batch)
            batches = [p.batch for p in row]
            if len(set(batches)) != len(batches):
                raise ValueError(f"decode points at context {context} repeat a batch: {batches}")
            self._rows.append((batches, [p.itl_s for p in row]))
        self.batches = sorted({b for batches, _ in self._rows for b in batches})
        self.max_context = self.contexts[-1]

    def max_batch_at(self, context_tokens: float) -> int:
        """The largest batch measured at ``context_tokens``: its row's, or between two
        rows the smaller of theirs (past it, ``itl_s`` extends a row). Rows differ: the
        profiler leaves out the batches whose KV does not fit at long contexts, and the
        smallest over all rows held short contexts to the longest's (the shipped CPU
        profile: 16 at context 256, measured to 64, so a worker 80% busy read 93%)."""
        i = bisect.bisect_left(self.contexts, context_tokens)
        if i < len(self.contexts) and self.contexts[i] == context_tokens:
            return self._rows[i][0][-1]
        below = self._rows[max(i - 1, 0)][0][-1]
        above = self._rows[min(i, len(self._rows) - 1)][0][-1]
        return min(below, above)

    def itl_s(self, batch: float, context_tokens: float) -> float:
        """One decode step's time for ``batch`` requests at a mean context of
        ``context_tokens``. Below the smallest batch or context measured: that one's time
        (a fraction of a request, a worker idle part of the time, still pays whole steps)."""
        per_context = [_linear(batches, itls, batch) for batches, itls in self._rows]
        return _linear(self.contexts, per_context, context_tokens)
