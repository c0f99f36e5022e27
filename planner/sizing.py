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
step). Short prompts the router prefills on decode workers take their share of its time
(``f``), stretching its steps: the tokens come at ``(1 - f) b / itl`` and a user sees
``itl / (1 - f)``. The fewest workers whose stretched step meets the ITL target with ``b``
within ``max_utilization`` of ``max_num_seqs`` and of the KV pool.

These are means under random arrivals; percentiles sit above them, which is what the
utilization cap is for. KV transfer time is not in the TTFT (the first token leaves the
prefill worker before its KV moves); it delays the second token.
"""

from __future__ import annotations

import math
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
    utilization: float  # of each worker
    ttft_s: float  # predicted mean, for disaggregated prompts (0: none)
    limit: str  # why one fewer worker is not enough ("" where none is needed)


@dataclass(frozen=True, slots=True)
class DecodeSizing:
    replicas: int
    batch: float  # requests in flight per worker, on average
    itl_s: float  # predicted mean, prefills on the worker included
    kv_fraction: float  # of each worker's KV pool the batch holds
    context_tokens: float  # mean context of a request in flight
    local_prefill_fraction: float  # of each worker's time spent prefilling short prompts
    limit: str


@dataclass(frozen=True, slots=True)
class Sizing:
    prefill: PrefillSizing
    decode: DecodeSizing
    warnings: tuple[str, ...]


def size(profile: Profile, demand: Demand, targets: Targets) -> Sizing:
    """The workers ``demand`` needs. Where no number of workers meets a target (one prompt
    alone is slower than the TTFT target; one request alone steps slower than the ITL
    target), the answer meets the rest and a warning says which target it cannot meet and
    why: adding workers does not help there, a faster device or more tensor parallelism
    does."""
    prefill_curve = PrefillCurve(profile.prefill.prefill)
    decode_curve = DecodeCurve(profile.decode.decode)
    warnings: list[str] = []
    remote = [s for s in demand.shapes if s.uncached_tokens >= targets.min_disagg_tokens]
    local = [s for s in demand.shapes if s.uncached_tokens < targets.min_disagg_tokens]
    share = demand.rate_per_s / len(demand.shapes)  # requests a second of each shape

    prefill_s = [s.uncached_tokens * prefill_curve.token_s(s.isl) for s in remote]
    prefill = _size_prefill(
        share * len(remote),
        _mean(prefill_s),
        _mean([t * t for t in prefill_s]),
        _mean([prefill_curve.latency_s(s.isl) * s.uncached_tokens / s.isl for s in remote]),
        targets,
        warnings,
    )
    local_busy = share * sum(s.uncached_tokens * prefill_curve.token_s(s.isl) for s in local)
    decode = _size_decode(profile, decode_curve, demand, share, local_busy, targets, warnings)
    longest = max((s.isl for s in demand.shapes), default=0)
    if longest > prefill_curve.max_isl:
        warnings.append(f"extrapolated beyond the profile: prompts of {longest} tokens "
                        f"(profiled up to {prefill_curve.max_isl})")  # fmt: skip
    if decode.batch > decode_curve.max_batch:
        warnings.append(f"extrapolated beyond the profile: a decode batch of {decode.batch:.0f} "
                        f"(profiled up to {decode_curve.max_batch})")  # fmt: skip
    if decode.context_tokens > decode_curve.max_context:
        warnings.append(f"extrapolated beyond the profile: a mean decode context of "
                        f"{decode.context_tokens:.0f} tokens (profiled up to "
                        f"{decode_curve.max_context})")  # fmt: skip
    return Sizing(prefill, decode, tuple(warnings))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _size_prefill(
    rate_per_s: float,
    mean_s: float,
    mean_square_s2: float,
    mean_alone_s: float,
    targets: Targets,
    warnings: list[str],
) -> PrefillSizing:
    if rate_per_s == 0:
        return PrefillSizing(0, 0.0, 0.0, "")
    busy = rate_per_s * mean_s  # busy workers needed, at 100% utilization
    meets_ttft = mean_alone_s <= targets.ttft_s
    if not meets_ttft:
        warnings.append(
            f"TTFT target {targets.ttft_s * 1000:.0f} ms cannot be met: an idle prefill worker "
            f"takes {mean_alone_s * 1000:.0f} ms for these prompts on average; sized for "
            f"{targets.max_utilization:.0%} utilization only"
        )
    limit = ""
    for replicas in range(1, MAX_WORKERS + 1):
        utilization = busy / replicas
        if utilization >= 1:
            limit = "prompt throughput"
            continue
        wait_s = (rate_per_s / replicas) * mean_square_s2 / (2 * (1 - utilization))
        ttft_s = mean_alone_s + wait_s
        if utilization > targets.max_utilization:
            limit = "utilization"
        elif meets_ttft and ttft_s > targets.ttft_s:
            limit = "ttft"
        else:
            return PrefillSizing(replicas, utilization, ttft_s, limit)
    raise ValueError(f"no layout of up to {MAX_WORKERS} prefill workers serves this demand")


def _size_decode(
    profile: Profile,
    curve: DecodeCurve,
    demand: Demand,
    share: float,
    local_busy: float,
    targets: Targets,
    warnings: list[str],
) -> DecodeSizing:
    engine = profile.decode.engine
    tokens = [s.osl - 1 for s in demand.shapes]
    total = sum(tokens)
    rate_tokens = share * total  # decode tokens a second, all workers
    # Mean context (and KV held) of a request in flight, weighted by how long it stays.
    context = (
        sum(t * (s.isl + t / 2) for t, s in zip(tokens, demand.shapes, strict=True)) / total
        if total
        else float(_mean([s.isl for s in demand.shapes]))
    )
    kv_tokens = context + engine.block_size  # its last block part-filled
    max_batch = targets.max_utilization * min(
        engine.max_num_seqs, engine.kv_capacity_tokens / kv_tokens
    )
    alone_itl = curve.itl_s(1, context)
    if alone_itl > targets.itl_s:
        warnings.append(
            f"ITL target {targets.itl_s * 1000:.1f} ms cannot be met: one request alone "
            f"decodes at {alone_itl * 1000:.1f} ms a token at a {context:.0f}-token context; "
            "sized for the batch and KV limits only"
        )
    limit = ""
    for replicas in range(1, MAX_WORKERS + 1):
        local_fraction = local_busy / replicas
        if local_fraction >= targets.max_utilization:
            limit = "local prefills"
            continue
        batch = _batch_for(curve, rate_tokens / replicas / (1 - local_fraction), context)
        if batch is None:
            limit = "step time"
            continue
        if batch > max_batch:
            seqs_bound = engine.max_num_seqs <= engine.kv_capacity_tokens / kv_tokens
            limit = "max_num_seqs" if seqs_bound else "kv"
            continue
        itl_s = curve.itl_s(batch, context) / (1 - local_fraction)
        if alone_itl <= targets.itl_s and itl_s > targets.itl_s:
            limit = "itl"
            continue
        return DecodeSizing(
            replicas, batch, itl_s, batch * kv_tokens / engine.kv_capacity_tokens, context,
            local_fraction, limit,
        )  # fmt: skip
    raise ValueError(f"no layout of up to {MAX_WORKERS} decode workers serves this demand")


def _batch_for(curve: DecodeCurve, tokens_per_s: float, context: float) -> float | None:
    """The smallest batch ``b`` at which a worker makes ``tokens_per_s`` (``b / itl(b) >=
    tokens_per_s``): where its queue settles, as requests pile up until their tokens come as
    fast as they are asked for. None if no batch up to 4 x the largest measured does (the
    curve's extension is trusted that far, no further). Below one request: the fraction of
    time a lone request is in flight. ``b / itl(b)`` need not rise throughout (a step's time
    can grow faster than its batch past a cache's size), so the batches are scanned from
    one up, not bisected over the whole range."""
    if tokens_per_s == 0:
        return 0.0
    alone = 1 / curve.itl_s(1, context)
    if tokens_per_s <= alone:
        return tokens_per_s / alone
    step = 0.25
    low = 1.0
    while low < curve.max_batch * 4:
        high = low + step
        if high / curve.itl_s(high, context) >= tokens_per_s:
            for _ in range(20):  # bisection inside the one step that crosses
                middle = (low + high) / 2
                if middle / curve.itl_s(middle, context) < tokens_per_s:
                    low = middle
                else:
                    high = middle
            return high
        low = high
    return None
