"""How many prefill and decode workers a demand needs to meet its latency targets.
Torch-free; every input is in the profile, the demand and the targets.

Prefill workers (the prompts the router disaggregates: at least ``min_disagg_tokens`` not
cached). A worker with prompts waiting computes them at its saturated speed, so a prompt
of ``u`` uncached tokens over an ``isl``-token context busies it for
``s = u * token_s(isl)``. Arrivals are random (Poisson) and spread evenly over the
workers, so each is an M/G/1 queue: its mean wait is Pollaczek-Khinchine's
``lambda E[s^2] / (2 (1 - rho))``, and a prompt's time to first token is that wait plus its
own latency alone. The fewest workers whose mean TTFT meets the target, at most
``max_utilization`` busy (headroom for bursts the mean does not show).

Decode workers. A request decodes ``osl - 1`` tokens there (its first comes with the
prefill) at a context of its prompt plus half its output on average, so the decode load is
``D`` tokens a second at a mean context ``c`` (weighted by how long each request stays).
With ``n`` workers each needs ``D / n`` tokens a second: it runs the batch ``b`` where
``b / itl(b, c) = D / n`` (Little's law: ``b`` requests in flight, one token each per
step), planned at most ``max_utilization`` of the most tokens a second the profile saw a
worker make (past that knee, a burst's extra requests slow every step and the batch runs
away). Short prompts the router prefills on decode workers take their share of its time
(``f``), stretching its steps: the tokens come at ``(1 - f) b / itl`` and a user sees
``itl / (1 - f)``. The fewest workers whose stretched step meets the ITL target with ``b``
within ``max_utilization`` of ``max_num_seqs`` and of the KV pool.

These are means under random arrivals; percentiles sit above them, which is what the
utilization cap is for. KV transfer time is not in the TTFT (the first token leaves the
prefill worker before its KV moves); it delays the second token.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from planner.curves import DecodeCurve, PrefillCurve
from planner.demand import Demand
from planner.profile_data import Profile

MAX_WORKERS = 4096


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float  # mean time to first token of disaggregated prompts
    itl_s: float  # mean time between tokens while decoding
    max_utilization: float = 0.85
    min_disagg_tokens: int = 256  # the router's: shorter uncached prompts stay on decode

    def __post_init__(self) -> None:
        for key in ("ttft_s", "itl_s"):
            value = getattr(self, key)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"the {key} target must be a finite number > 0, got {value}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        if self.min_disagg_tokens < 0:
            raise ValueError(f"min_disagg_tokens must be >= 0, got {self.min_disagg_tokens}")


@dataclass(frozen=True, slots=True)
class PrefillSizing:
    replicas: int
    utilization: float  # of each worker (>= 1: the queue grows without end)
    ttft_s: float  # predicted mean, for disaggregated prompts (0: none; inf: no end)
    limit: str  # sized: why one fewer worker is not enough; predicted: the target missed


@dataclass(frozen=True, slots=True)
class DecodeSizing:
    replicas: int
    utilization: float  # of the most tokens a second a worker was measured to make
    batch: float  # requests in flight per worker, on average (inf: more than it can make)
    itl_s: float  # predicted mean, prefills on the worker included
    kv_fraction: float  # of each worker's KV pool the batch holds
    context_tokens: float  # mean context of a request in flight
    local_prefill_fraction: float  # of each worker's time spent prefilling short prompts
    limit: str


@dataclass(frozen=True, slots=True)
class Sizing:
    prefill: PrefillSizing
    decode: DecodeSizing
    notes: tuple[Note, ...]  # ``describe`` words them


def size(profile: Profile, demand: Demand, targets: Targets) -> Sizing:
    """The fewest workers of each role ``demand`` needs. Where no number of workers meets a
    target (one prompt alone is slower than the TTFT target; one request alone steps
    slower than the ITL target), the answer meets the rest and a warning says which target
    it cannot meet and why: adding workers does not help there, a faster device or more
    tensor parallelism does."""
    model = _Model(profile, demand, targets)
    prefill = _fewest(model.prefill, "prefill") if model.prefill_rate_per_s else model.prefill(0)
    decode = _fewest(model.decode, "decode")
    return Sizing(prefill, decode, model.notes(decode))


def predict(
    profile: Profile, demand: Demand, targets: Targets, prefill_replicas: int,
    decode_replicas: int,
) -> Sizing:  # fmt: skip
    """What a given layout would see under ``demand``; each role's ``limit`` names the
    target it misses ("" where it meets them all)."""
    if decode_replicas < 1 or prefill_replicas < 0:
        raise ValueError("a layout needs at least one decode worker and no fewer than 0 prefill")
    model = _Model(profile, demand, targets)
    decode = model.decode(decode_replicas)
    return Sizing(model.prefill(prefill_replicas), decode, model.notes(decode))


def _fewest(at, role: str):
    """The first of ``at(1), at(2), ...`` with no limit missed, its ``limit`` the one
    ``at(n - 1)`` missed."""
    missed = ""
    for replicas in range(1, MAX_WORKERS + 1):
        sizing = at(replicas)
        if not sizing.limit:
            return dataclasses.replace(sizing, limit=missed)
        missed = sizing.limit
    raise ValueError(f"no layout of up to {MAX_WORKERS} {role} workers serves this demand")


class _Model:
    """One demand's load on each role, as functions of the workers serving it."""

    def __init__(self, profile: Profile, demand: Demand, targets: Targets) -> None:
        self.targets = targets
        self.prefill_curve = PrefillCurve(profile.prefill.prefill)
        self.decode_curve = DecodeCurve(profile.decode.decode)
        self.engine = profile.decode.engine
        self.shapes = demand.shapes
        share = demand.rate_per_s / len(demand.shapes)  # requests a second of each shape
        remote = [s for s in demand.shapes if s.uncached_tokens >= targets.min_disagg_tokens]
        local = [s for s in demand.shapes if s.uncached_tokens < targets.min_disagg_tokens]
        # Prefill workers: each prompt's service time and latency alone.
        service_s = [s.uncached_tokens * self.prefill_curve.token_s(s.isl) for s in remote]
        self.prefill_rate_per_s = share * len(remote)
        self.mean_service_s = _mean(service_s)
        self.mean_square_service_s2 = _mean([t * t for t in service_s])
        self.mean_alone_s = _mean([self.prefill_curve.latency_s(s.isl) * s.uncached_tokens / s.isl
                                   for s in remote])  # fmt: skip
        # Decode workers: tokens a second, the context they are made at, local prefills.
        tokens = [s.osl - 1 for s in demand.shapes]
        total = sum(tokens)
        self.decode_tokens_per_s = share * total
        # Mean context (and KV held) of a request in flight, weighted by how long it stays.
        self.context = (
            sum(t * (s.isl + t / 2) for t, s in zip(tokens, demand.shapes, strict=True)) / total
            if total
            else float(_mean([s.isl for s in demand.shapes]))
        )
        self.kv_tokens = self.context + self.engine.block_size  # its last block part-filled
        self.local_busy = share * sum(
            s.uncached_tokens * self.prefill_curve.token_s(s.isl) for s in local
        )
        self.alone_itl_s = self.decode_curve.itl_s(1, self.context)
        # The most tokens a second a worker was measured making at this context: the
        # batches past it only add time (a step growing faster than its batch), and close
        # to it a random burst's extra requests slow every step, so it is planned at most
        # ``max_utilization`` busy, as a prefill worker is.
        self.peak_tokens_per_s = max(
            b / self.decode_curve.itl_s(b, self.context)
            for b in _batches(self.decode_curve, self.decode_curve.max_batch)
        )

    def prefill(self, replicas: int) -> PrefillSizing:
        if self.prefill_rate_per_s == 0:
            return PrefillSizing(replicas, 0.0, 0.0, "")
        if replicas == 0:
            return PrefillSizing(0, math.inf, math.inf, "prompt throughput")
        utilization = self.prefill_rate_per_s * self.mean_service_s / replicas
        if utilization >= 1:
            return PrefillSizing(replicas, utilization, math.inf, "prompt throughput")
        wait_s = (
            (self.prefill_rate_per_s / replicas)
            * self.mean_square_service_s2
            / (2 * (1 - utilization))
        )
        ttft_s = self.mean_alone_s + wait_s
        limit = ""
        if utilization > self.targets.max_utilization:
            limit = "utilization"
        elif self.mean_alone_s <= self.targets.ttft_s < ttft_s:
            limit = "ttft"
        return PrefillSizing(replicas, utilization, ttft_s, limit)

    def decode(self, replicas: int) -> DecodeSizing:
        local_fraction = self.local_busy / replicas
        engine = self.engine
        if local_fraction >= 1:
            return DecodeSizing(replicas, math.inf, math.inf, math.inf, math.inf, self.context,
                                local_fraction, "local prefills")  # fmt: skip
        tokens_per_s = self.decode_tokens_per_s / replicas / (1 - local_fraction)
        utilization = tokens_per_s / self.peak_tokens_per_s
        batch = _batch_for(self.decode_curve, tokens_per_s, self.context)
        if batch is None:
            return DecodeSizing(replicas, utilization, math.inf, math.inf, math.inf,
                                self.context, local_fraction, "step time")  # fmt: skip
        itl_s = self.decode_curve.itl_s(batch, self.context) / (1 - local_fraction)
        cap = self.targets.max_utilization
        limit = ""
        if local_fraction >= cap:
            limit = "local prefills"
        elif utilization > cap:
            limit = "utilization"
        elif batch > cap * min(engine.max_num_seqs, engine.kv_capacity_tokens / self.kv_tokens):
            seqs_bound = engine.max_num_seqs <= engine.kv_capacity_tokens / self.kv_tokens
            limit = "max_num_seqs" if seqs_bound else "kv"
        elif self.alone_itl_s <= self.targets.itl_s < itl_s:
            limit = "itl"
        return DecodeSizing(
            replicas, utilization, batch, itl_s,
            batch * self.kv_tokens / engine.kv_capacity_tokens, self.context, local_fraction,
            limit,
        )  # fmt: skip

    def notes(self, decode: DecodeSizing) -> tuple[Note, ...]:
        """Targets no layout meets, and answers that lean on extending the profile."""
        targets, notes = self.targets, []
        if self.prefill_rate_per_s and self.mean_alone_s > targets.ttft_s:
            notes.append(Note("ttft_floor", self.mean_alone_s * 1000, targets.ttft_s * 1000))
        if self.alone_itl_s > targets.itl_s:
            notes.append(Note("itl_floor", self.alone_itl_s * 1000, targets.itl_s * 1000))
        longest = max(s.isl for s in self.shapes)
        if longest > self.prefill_curve.max_isl:
            notes.append(Note("isl", longest, self.prefill_curve.max_isl))
        if math.isfinite(decode.batch) and decode.batch > self.decode_curve.max_batch:
            notes.append(Note("batch", decode.batch, self.decode_curve.max_batch))
        if self.context > self.decode_curve.max_context:
            notes.append(Note("context", self.context, self.decode_curve.max_context))
        return tuple(notes)


@dataclass(frozen=True, slots=True)
class Note:
    """Something a sizing leans on or cannot meet: ``kind`` (``_NOTE_TEXT``), the demand's
    ``value`` and the ``reference`` it passes (a target, the profile's largest point)."""

    kind: str
    value: float
    reference: float


_NOTE_TEXT = {
    "ttft_floor": "TTFT target {reference:.0f} ms cannot be met: an idle prefill worker takes "
                  "{value:.0f} ms for these prompts on average; more workers do not help (a "
                  "faster device, tensor parallelism or a smaller model do): sized for "
                  "utilization only",
    "itl_floor": "ITL target {reference:.1f} ms cannot be met: one request alone decodes at "
                 "{value:.1f} ms a token; more workers do not help: sized for the batch and KV "
                 "limits only",
    "isl": "extrapolated beyond the profile: prompts of {value:.0f} tokens (profiled up to "
           "{reference:.0f})",
    "batch": "extrapolated beyond the profile: a decode batch of {value:.0f} (profiled up to "
             "{reference:.0f})",
    "context": "extrapolated beyond the profile: a mean decode context of {value:.0f} tokens "
               "(profiled up to {reference:.0f})",
}  # fmt: skip


def describe(notes: Iterable[Note]) -> list[str]:
    """One line per kind of note, the worst value of that kind (over a trace's windows)."""
    worst: dict[str, Note] = {}
    for note in notes:
        if note.kind not in worst or note.value > worst[note.kind].value:
            worst[note.kind] = note
    return [_NOTE_TEXT[n.kind].format(value=n.value, reference=n.reference)
            for n in worst.values()]  # fmt: skip


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _batches(curve: DecodeCurve, upto: float) -> list[float]:
    """1, the batches measured, ``upto``: between two of them a step's time is linear in
    the batch (``a + k b``, at any context), so ``b / itl(b)`` is monotonic there and its
    extremes and crossings are found from these points alone."""
    return [1.0, *(float(b) for b in curve.batches if 1 < b < upto), float(upto)]


def _batch_for(curve: DecodeCurve, tokens_per_s: float, context: float) -> float | None:
    """The smallest batch ``b`` at which a worker makes ``tokens_per_s`` (``b / itl(b) >=
    tokens_per_s``): where its queue settles, as requests pile up until their tokens come as
    fast as they are asked for. None if no batch up to 4 x the largest measured does (the
    curve's extension is trusted that far, no further). Below one request: the fraction of
    time a lone request is in flight. ``b / itl(b)`` need not rise throughout (a step's time
    can grow faster than its batch past a cache's size), so the measured batches are
    scanned from one up and only the span that crosses is bisected."""
    if tokens_per_s == 0:
        return 0.0
    alone = 1 / curve.itl_s(1, context)
    if tokens_per_s <= alone:
        return tokens_per_s / alone
    batches = _batches(curve, curve.max_batch * 4)
    for low, high in itertools.pairwise(batches):
        if high / curve.itl_s(high, context) >= tokens_per_s:
            for _ in range(20):  # bisection inside the one step that crosses
                middle = (low + high) / 2
                if middle / curve.itl_s(middle, context) < tokens_per_s:
                    low = middle
                else:
                    high = middle
            return high
    return None
