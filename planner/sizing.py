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
With ``n`` workers each makes ``D / n`` tokens a second. Its batch is not fixed: requests
come at random and each stays for as many steps as it has tokens to make, every step of
``k`` requests taking ``itl(k, c)``. That is a symmetric queue (all in it served at once,
at a speed set by how many there are), whose number in the system ``N`` has the
product-form law ``P(N) ~ prod_{j <= N} (D / n) itl(j) / j`` whatever the output
lengths (Kelly; at most ``max_num_seqs`` run, the rest wait). For step times linear in
the batch, ``a + c k``, it is a negative binomial and the mean ITL is
``itl(1) / (1 - c D / n)``. A step of ``k`` makes ``k`` tokens, each ``itl(k)`` after its
request's last, so tokens see batch ``k`` in proportion to ``P(k) k / itl(k)``: that is
the ITL's distribution, its mean ``E[running] / (D / n)`` (Little's law). Each worker is
planned at most ``max_utilization`` of the most tokens a second the profile saw one make
(past that knee, a burst's extra requests slow every step and the batch runs away). Short
prompts the router prefills on decode workers take their share of its time (``f``),
stretching its steps: the tokens come at ``(1 - f)`` of the rate and a user sees
``itl / (1 - f)``. The fewest workers whose stretched ITL meets the target with the mean
batch within ``max_utilization`` of ``max_num_seqs`` and of the KV pool.

Targets are means, or percentiles (``ttft_percentile``, ``itl_percentile``: "p90 TTFT
under 2 s"). A percentile needs the spread, not just the mean:

* TTFT. In an M/G/1 queue an arrival waits with probability ``rho``, and a wait, once
  there is one, is close to exponential with mean ``E[W] / rho`` (exact for exponential
  service times, the heavy-traffic limit for any). A prompt's TTFT is its wait plus its
  own latency alone, so the fraction of prompts slower than ``t`` is the mean over the
  demand's shapes of ``P(W > t - alone)``; the percentile is the ``t`` where that is
  ``1 - p``.
* ITL: the percentile of the distribution above.

``tests/planner/test_percentiles.py`` holds both against simulated queues. Means and
percentiles are under random (Poisson) arrivals; the utilization cap is headroom for
bursts beyond them. KV transfer time is not in the TTFT (the first token leaves the
prefill worker before its KV moves); it delays the second token.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from planner.curves import DecodeCurve, PrefillCurve
from planner.demand import Demand
from planner.profile_data import Profile

MAX_WORKERS = 4096


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float  # time to first token of disaggregated prompts
    itl_s: float  # time between tokens while decoding
    max_utilization: float = 0.85
    min_disagg_tokens: int = 256  # the router's: shorter uncached prompts stay on decode
    ttft_percentile: float | None = None  # None: ``ttft_s`` is a mean; 90: a p90
    itl_percentile: float | None = None

    def __post_init__(self) -> None:
        for key in ("ttft_s", "itl_s"):
            value = getattr(self, key)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"the {key} target must be a finite number > 0, got {value}")
        for key in ("ttft_percentile", "itl_percentile"):
            value = getattr(self, key)
            if value is not None and not 0 < value < 100:
                raise ValueError(f"{key} must be in (0, 100), got {value}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        if self.min_disagg_tokens < 0:
            raise ValueError(f"min_disagg_tokens must be >= 0, got {self.min_disagg_tokens}")

    @property
    def ttft_statistic(self) -> str:
        """What ``ttft_s`` bounds, in words: "mean" or "p90"."""
        return statistic(self.ttft_percentile)

    @property
    def itl_statistic(self) -> str:
        return statistic(self.itl_percentile)

    def means(self) -> Targets:
        """These targets as means: what a window's mean latencies are compared with."""
        return dataclasses.replace(self, ttft_percentile=None, itl_percentile=None)


def statistic(percentile: float | None) -> str:
    return "mean" if percentile is None else f"p{percentile:g}"


@dataclass(frozen=True, slots=True)
class PrefillSizing:
    replicas: int
    utilization: float  # of each worker (>= 1: the queue grows without end)
    ttft_s: float  # predicted, the target's statistic (0: no prompts; inf: no end); with
    # 0 replicas in a given layout, that of the prompts the decode workers prefill
    limit: str  # sized: why one fewer worker is not enough; predicted: the target missed


@dataclass(frozen=True, slots=True)
class DecodeSizing:
    replicas: int
    utilization: float  # of the most tokens a second a worker was measured to make
    batch: float  # requests in each worker (running or waiting), on average (inf: no end)
    itl_s: float  # predicted, the target's statistic, prefills on the worker included
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
    tensor parallelism does. So too where a target is met alone but so close to that
    floor that ``MAX_WORKERS`` still miss it (a p99 a few % above a lone request's step):
    only ever more workers approach it, and the warning says how close they get."""
    out_of_reach: dict[str, float] = {}
    while True:
        model = _Model(profile, demand, targets, out_of_reach)
        try:
            prefill = (
                _fewest(model.prefill, "prefill") if model.prefill_rate_per_s else model.prefill(0)
            )
            decode = _fewest(model.decode, "decode")
        except _OutOfReach as missed:
            out_of_reach[missed.limit] = missed.latency_s
            continue
        return Sizing(prefill, decode, model.notes(decode))


def predict(
    profile: Profile, demand: Demand, targets: Targets, prefill_replicas: int,
    decode_replicas: int,
) -> Sizing:  # fmt: skip
    """What a given layout would see under ``demand``; each role's ``limit`` names the
    target it misses ("" where it meets them all)."""
    if decode_replicas < 1 or prefill_replicas < 0:
        raise ValueError("a layout needs at least one decode worker and no fewer than 0 prefill")
    if prefill_replicas:
        model = _Model(profile, demand, targets)
        decode = model.decode(decode_replicas)
        return Sizing(model.prefill(prefill_replicas), decode, model.notes(decode))
    # The router prefills every prompt on the decode workers. Their TTFT: each decode
    # worker a queue of prompts at the profile's prefill speed (optimistic: its decode
    # steps take their share of its time too). It was reported as 0 ms and no miss.
    local = dataclasses.replace(targets, min_disagg_tokens=math.inf)  # type: ignore[arg-type]
    model = _Model(profile, demand, local)
    decode = model.decode(decode_replicas)
    prompts = _Model(profile, demand, targets, queue_all=True)
    if not prompts.alone_counts:  # no prompt is long enough for the target (as ``size``)
        return Sizing(PrefillSizing(0, 0.0, 0.0, ""), decode, model.notes(decode))
    ttft_s = prompts.prefill(decode_replicas).ttft_s
    prefill = PrefillSizing(0, 0.0, ttft_s, "ttft" if ttft_s > targets.ttft_s else "")
    floor = tuple(n for n in prompts.notes(decode) if n.kind == "ttft_floor")
    return Sizing(prefill, decode, model.notes(decode) + floor)


class _OutOfReach(Exception):
    """``MAX_WORKERS`` of a role still miss only its latency target ``limit`` ("ttft",
    "itl"), predicting ``latency_s``: the target sits just above what one worker alone
    gives, which only ever more workers approach."""

    def __init__(self, limit: str, latency_s: float) -> None:
        super().__init__(limit, latency_s)
        self.limit, self.latency_s = limit, latency_s


def _fewest(at, role: str):
    """The smallest ``n >= 1`` whose ``at(n)`` misses no limit, its ``limit`` the one
    ``at(n - 1)`` missed. More workers never miss a limit fewer meet (each role's load per
    worker, queue and batch only fall), so it is found by doubling the step and then
    bisecting: a few sizings, not one per worker count (a percentile's costs a pass over
    the demand's shapes). Raises ``_OutOfReach`` where ``MAX_WORKERS`` miss a latency
    target, ``ValueError`` where they miss another limit."""
    sized: dict[int, object] = {}

    def meets(n: int) -> bool:
        if n not in sized:
            sized[n] = at(n)
        return not sized[n].limit

    missing, meeting, step = 0, 1, 1  # the most known to miss; the next tried
    while not meets(meeting):
        missing = meeting
        if meeting >= MAX_WORKERS:
            most = sized[meeting]
            if most.limit in ("ttft", "itl"):
                raise _OutOfReach(most.limit, most.ttft_s if most.limit == "ttft" else most.itl_s)
            raise ValueError(f"no layout of up to {MAX_WORKERS} {role} workers serves this "
                             f"demand ({MAX_WORKERS} still miss: {most.limit})")  # fmt: skip
        meeting = min(meeting + step, MAX_WORKERS)
        step *= 2
    while meeting - missing > 1:
        middle = (missing + meeting) // 2
        if meets(middle):
            meeting = middle
        else:
            missing = middle
    missed = "" if meeting == 1 or meets(meeting - 1) else sized[meeting - 1].limit
    return dataclasses.replace(sized[meeting], limit=missed)


class _Model:
    """One demand's load on each role, as functions of the workers serving it."""

    def __init__(
        self, profile: Profile, demand: Demand, targets: Targets,
        out_of_reach: dict[str, float] | None = None, queue_all: bool = False,
    ) -> None:  # fmt: skip
        """``out_of_reach``: latency targets ("ttft", "itl") no layout meets, against
        what ``MAX_WORKERS`` predict; sized without them (``_OutOfReach``).
        ``queue_all``: every prompt queues for the prefill side (a layout whose decode
        workers prefill them all), the TTFT still that of the prompts the target is for."""
        self.targets = targets
        self.out_of_reach = dict(out_of_reach or {})
        self.prefill_curve = PrefillCurve(profile.prefill.prefill)
        self.decode_curve = DecodeCurve(profile.decode.decode)
        self.engine = profile.decode.engine
        self.shapes = demand.shapes
        share = demand.rate_per_s / len(demand.shapes)  # requests a second of each shape
        remote = [s for s in demand.shapes if s.uncached_tokens >= targets.min_disagg_tokens]
        local = [s for s in demand.shapes if s.uncached_tokens < targets.min_disagg_tokens]
        # Prefill workers: each prompt's service time and latency alone.
        queued = demand.shapes if queue_all else remote
        service_s = [s.uncached_tokens * self.prefill_curve.token_s(s.isl) for s in queued]
        self.prefill_rate_per_s = share * len(queued)
        self.mean_service_s = _mean(service_s)
        self.mean_square_service_s2 = _mean([t * t for t in service_s])
        alone_s = [self.prefill_curve.latency_s(s.isl) * s.uncached_tokens / s.isl for s in remote]
        self.mean_alone_s = _mean(alone_s)
        self.alone_counts = sorted(Counter(alone_s).items())  # a percentile's inputs
        self.alone_ttft_s = self._ttft(0.0, 0.0)  # no layout is faster
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
            for b in _batches(self.decode_curve, self.decode_curve.max_batch_at(self.context))
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
        ttft_s = self._ttft(utilization, wait_s)
        limit = ""
        if utilization > self.targets.max_utilization:
            limit = "utilization"
        elif "ttft" not in self.out_of_reach and self.alone_ttft_s <= self.targets.ttft_s < ttft_s:
            limit = "ttft"
        return PrefillSizing(replicas, utilization, ttft_s, limit)

    def _ttft(self, utilization: float, wait_s: float) -> float:
        """The target's statistic of TTFT with a mean wait ``wait_s`` at ``utilization``."""
        if self.targets.ttft_percentile is None:
            return self.mean_alone_s + wait_s
        if not self.alone_counts:  # no prompts for prefill workers
            return 0.0
        fraction = self.targets.ttft_percentile / 100
        return _ttft_quantile(self.alone_counts, utilization, wait_s, fraction)

    def decode(self, replicas: int) -> DecodeSizing:
        local_fraction = self.local_busy / replicas
        engine = self.engine
        if local_fraction >= 1:
            return DecodeSizing(replicas, math.inf, math.inf, math.inf, math.inf, self.context,
                                local_fraction, "local prefills")  # fmt: skip
        tokens_per_s = self.decode_tokens_per_s / replicas / (1 - local_fraction)
        utilization = tokens_per_s / self.peak_tokens_per_s
        law = _batch_law(self.decode_curve, tokens_per_s, self.context, engine.max_num_seqs)
        if law is None or not math.isfinite(law.mean_requests):
            limit = "step time" if law is None else "max_num_seqs"  # (the queue never drains)
            return DecodeSizing(replicas, utilization, math.inf, math.inf, math.inf,
                                self.context, local_fraction, limit)  # fmt: skip
        batch = law.mean_requests
        if self.targets.itl_percentile is None:
            step_s = law.mean_itl_s()
        else:
            step_s = law.itl_quantile_s(self.targets.itl_percentile / 100)
        itl_s = step_s / (1 - local_fraction)
        cap = self.targets.max_utilization
        limit = ""
        if local_fraction >= cap:
            limit = "local prefills"
        elif utilization > cap:
            limit = "utilization"
        elif batch > cap * min(engine.max_num_seqs, engine.kv_capacity_tokens / self.kv_tokens):
            seqs_bound = engine.max_num_seqs <= engine.kv_capacity_tokens / self.kv_tokens
            limit = "max_num_seqs" if seqs_bound else "kv"
        elif "itl" not in self.out_of_reach and self.alone_itl_s <= self.targets.itl_s < itl_s:
            limit = "itl"
        return DecodeSizing(
            replicas, utilization, batch, itl_s,
            batch * self.kv_tokens / engine.kv_capacity_tokens, self.context, local_fraction,
            limit,
        )  # fmt: skip

    def notes(self, decode: DecodeSizing) -> tuple[Note, ...]:
        """Targets no layout meets, and answers that lean on extending the profile."""
        targets, notes = self.targets, []
        if self.prefill_rate_per_s and self.alone_ttft_s > targets.ttft_s:
            notes.append(Note("ttft_floor", self.alone_ttft_s * 1000, targets.ttft_s * 1000,
                              targets.ttft_statistic))  # fmt: skip
        if self.alone_itl_s > targets.itl_s:
            notes.append(Note("itl_floor", self.alone_itl_s * 1000, targets.itl_s * 1000))
        if "ttft" in self.out_of_reach:
            notes.append(Note("ttft_reach", self.out_of_reach["ttft"] * 1000,
                              targets.ttft_s * 1000, targets.ttft_statistic))  # fmt: skip
        if "itl" in self.out_of_reach:
            notes.append(Note("itl_reach", self.out_of_reach["itl"] * 1000,
                              targets.itl_s * 1000, targets.itl_statistic))  # fmt: skip
        longest = max(s.isl for s in self.shapes)
        if longest > self.prefill_curve.max_isl:
            notes.append(Note("isl", longest, self.prefill_curve.max_isl))
        measured = self.decode_curve.max_batch_at(self.context)
        if math.isfinite(decode.batch) and decode.batch > measured:
            notes.append(Note("batch", decode.batch, measured))
        if self.context > self.decode_curve.max_context:
            notes.append(Note("context", self.context, self.decode_curve.max_context))
        return tuple(notes)


@dataclass(frozen=True, slots=True)
class Note:
    """Something a sizing leans on or cannot meet: ``kind`` (``_NOTE_TEXT``), the demand's
    ``value`` and the ``reference`` it passes (a target, the profile's largest point);
    ``statistic``: of a TTFT, "mean" or a percentile."""

    kind: str
    value: float
    reference: float
    statistic: str = "mean"


_NOTE_TEXT = {
    "ttft_floor": "TTFT target {reference:.0f} ms ({statistic}) cannot be met: an idle prefill "
                  "worker's {statistic} for these prompts is {value:.0f} ms; more workers do "
                  "not help (a faster device, tensor parallelism or a smaller model do): sized "
                  "for utilization only",
    "itl_floor": "ITL target {reference:.1f} ms cannot be met: one request alone decodes at "
                 "{value:.1f} ms a token; more workers do not help: sized for the batch and KV "
                 "limits only",
    "ttft_reach": "TTFT target {reference:.0f} ms ({statistic}) is out of reach: it is "
                  "barely above an idle prefill worker's, which only ever more workers "
                  f"approach ({MAX_WORKERS} would give {{value:.0f}} ms): sized for "
                  "utilization only; relax it",
    "itl_reach": "ITL target {reference:.1f} ms ({statistic}) is out of reach: it is barely "
                 "above a lone request's step, which only ever more workers approach "
                 f"({MAX_WORKERS} would give {{value:.1f}} ms): sized for the batch and KV "
                 "limits only; relax it",
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
    return [_NOTE_TEXT[n.kind].format(value=n.value, reference=n.reference,
                                      statistic=n.statistic)
            for n in worst.values()]  # fmt: skip


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _batches(curve: DecodeCurve, upto: float) -> list[float]:
    """1, the batches measured, ``upto``: between two of them a step's time is linear in
    the batch (``a + k b``, at any context), so ``b / itl(b)`` is monotonic there and its
    extremes and crossings are found from these points alone."""
    return [1.0, *(float(b) for b in curve.batches if 1 < b < upto), float(upto)]


@dataclass(frozen=True, slots=True)
class _BatchLaw:
    """A decode worker's batch at random: ``mean_requests`` in it (running or waiting),
    and ``token_weights``: each step time against the share of tokens made at it."""

    mean_requests: float
    token_weights: dict[float, float]

    def mean_itl_s(self) -> float:
        total = sum(self.token_weights.values())
        return sum(step_s * w for step_s, w in self.token_weights.items()) / total

    def itl_quantile_s(self, fraction: float) -> float:
        """The step time within which ``fraction`` of the tokens come."""
        total, seen = sum(self.token_weights.values()), 0.0
        for step_s in sorted(self.token_weights):
            seen += self.token_weights[step_s]
            if seen >= fraction * total * (1 - 1e-12):
                return step_s
        return max(self.token_weights)


def _batch_law(
    curve: DecodeCurve, tokens_per_s: float, context: float, max_num_seqs: int
) -> _BatchLaw | None:
    """The law of a decode worker's batch when it makes ``tokens_per_s`` (the module
    docstring's product form). None where the worker cannot keep up: no batch up to 4 x
    the largest measured makes that many (the curve's extension is trusted that far, no
    further), or a burst past the knee never drains (steps growing faster than the batch
    there, the law rises again after its bulk and never falls: ``mean_requests`` infinite
    says so where ``max_num_seqs`` running make too few instead). A second rise behind a
    dip below ``e^-10`` of the bulk's peak is a burst too rare to plan for, and left out,
    as is a tail below ``e^-40``. Past ``max_num_seqs`` every term is the last one's times
    the same ratio, summed in closed form."""
    if tokens_per_s == 0:
        return _BatchLaw(0.0, {curve.itl_s(1, context): 1.0})
    most = max(
        b / curve.itl_s(b, context) for b in _batches(curve, curve.max_batch_at(context) * 4)
    )
    if most < tokens_per_s:
        return None
    log_p, peak = 0.0, 0.0
    log_ps = [0.0]  # the law's logarithm, unnormalized, from N = 0
    j = 1
    while True:
        running = min(j, max_num_seqs)
        ratio = tokens_per_s * curve.itl_s(running, context) / running  # p_j / p_(j-1)
        if (ratio >= 1 and log_p < peak - 10) or (ratio < 1 and log_p < peak - 40):
            ratio = 0.0  # past the bulk: the rest is negligible
            break
        if j >= max_num_seqs:
            break  # the geometric tail from here on
        if (
            ratio >= 1
            and j > curve.batches[-1]
            and (tokens_per_s * (curve.itl_s(j + 1, context) - curve.itl_s(j, context)) >= 1)
        ):
            break  # past the profile a step is linear in j: the ratio stays >= 1 to the cap
        log_p += math.log(ratio)
        peak = max(peak, log_p)
        log_ps.append(log_p)
        j += 1
    if ratio >= 1:
        most_running = max(b / curve.itl_s(b, context) for b in _batches(curve, max_num_seqs))
        return _BatchLaw(math.inf, {}) if most_running <= tokens_per_s else None
    probabilities = [math.exp(x - peak) for x in log_ps]  # scaled by e^-peak: no overflow
    # N = max_num_seqs + m for m = 0, 1, ...: p r^m, p = the last term's times r.
    last = math.exp(log_p - peak) * ratio
    tail_mass = last / (1 - ratio)
    tail_mean = last * (j / (1 - ratio) + ratio / (1 - ratio) ** 2)
    total = sum(probabilities) + tail_mass
    mean_requests = (sum(n * p for n, p in enumerate(probabilities)) + tail_mean) / total
    weights: dict[float, float] = {}
    for n, p in enumerate(probabilities[1:], start=1):
        step_s = curve.itl_s(n, context)
        weights[step_s] = weights.get(step_s, 0.0) + p / total * n / step_s
    if tail_mass:
        step_s = curve.itl_s(max_num_seqs, context)
        weights[step_s] = weights.get(step_s, 0.0) + tail_mass / total * max_num_seqs / step_s
    return _BatchLaw(mean_requests, weights)


def _ttft_quantile(
    alone_counts: list[tuple[float, int]], utilization: float, wait_s: float, fraction: float
) -> float:
    """The TTFT within which ``fraction`` of prompts have their first token
    (``alone_counts``: each latency alone, ascending, and how many prompts have it). A
    prompt waits at all with probability ``utilization``, and then near exponentially with
    mean ``wait_s / utilization`` (rate ``k``), so the share slower than ``t`` is that of
    prompts slower alone plus ``utilization * sum_{a <= t} n_a e^(-k (t - a))`` over the
    rest; the sum is ``e^(L_i - k t)`` with ``L_i`` the running log-sum of ``n_a e^(k a)``
    (one pass, no overflow), and ``t`` is bisected on it."""
    values = [a for a, _ in alone_counts]
    cumulative = list(itertools.accumulate(n for _, n in alone_counts))
    total, tail = cumulative[-1], 1 - fraction
    if utilization <= 0 or wait_s <= 0:
        # Nobody waits: the first latency with fewer than ``tail`` of prompts slower. Fewer,
        # not at most: with any wait at all a prompt at that latency is slower than it, so
        # where the latencies' shares reach ``fraction`` exactly, the next one is the limit
        # the percentile takes as the load falls (the floor no layout goes below).
        return next(a for a, seen in zip(values, cumulative, strict=True)
                    if total - seen < tail * total * (1 - 1e-9))  # fmt: skip
    rate = utilization / wait_s
    log_sums, log_sum = [], -math.inf
    for a, n in alone_counts:
        term = math.log(n) + rate * a
        high, low = max(log_sum, term), min(log_sum, term)
        log_sum = high + math.log1p(math.exp(low - high))
        log_sums.append(log_sum)

    def slower(t: float) -> float:
        i = bisect.bisect_right(values, t)  # values[:i] <= t
        if i == 0:
            return 1.0
        waiting = utilization * math.exp(log_sums[i - 1] - rate * t)
        return (total - cumulative[i - 1] + waiting) / total

    low, high = values[0], values[-1]
    if utilization > tail:  # each shape's share slower is <= tail past here
        high += math.log(utilization / tail) / rate
    if slower(low) <= tail:
        return low
    for _ in range(60):
        middle = (low + high) / 2
        if slower(middle) > tail:
            low = middle
        else:
            high = middle
    return high
