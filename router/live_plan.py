"""The router's live plan: the layout what it served lately needs (``planner.*`` config).

The router sees every sequence end: its prompt, how much of it a worker had cached, how
many tokens it generated, and when they came. Those of the last ``window_s`` are a
``Demand`` (their rate and shapes), sized every ``interval_s`` against the deployment's
profile (``planner/sizing.py``, the same model as ``pdserve plan size``); the answer is in
the router's metrics, for ``pdserve up`` (``deploy/autoscale.py``), a Kubernetes
autoscaler or an operator:

* ``pdserve:planned_replicas{role}``: the workers each role needs;
* ``pdserve:planned_demand_requests_per_second``: the rate it was sized for;
* ``pdserve:planned_ttft_seconds`` and ``pdserve:planned_itl_seconds``: what the planned
  layout is predicted to give (the targets' statistics: means, or percentiles);
* ``pdserve:planner_correction{role}``: how much slower (above 1) or faster the workers
  were seen to be than their profile.

**Correction** (``planner.correct``, on by default, as Dynamo's SLA planner does): a
profile measured on an idle worker misses what serving adds (the router, gRPC, streaming,
the worker's own threads; on small models or shared hosts that is a lot:
``benchmarks/results/planner_cpu.md``). So each interval finds, per role, the factor on
the profile's times at which it predicts the window's mean TTFT (ITL) for the layout
that served it (the workers available now), and the next sizing uses the profile scaled
by it (smoothed, bounded). Solving for the factor, not taking observed / predicted as
one: slower steps mean bigger batches and longer queues, so a profile scaled by the raw
ratio would predict more than was seen, and plan for more workers than needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from common.config import PlannerConfig, Role
from planner.demand import Demand, RequestShape
from planner.profile_data import Profile, read_profile, scaled
from planner.sizing import Sizing, Targets, describe, predict, size

logger = logging.getLogger(__name__)

MAX_SHAPES = 4096  # the most recent sequences a demand holds (its rate counts them all)
CORRECTION_BOUNDS = (0.25, 8.0)  # a factor outside is a transient (a burst, a restart)
CORRECTION_SHAPES = 256  # the window's shapes a correction is solved on
SMOOTHING = 0.5  # weight of the newest ratio


@dataclass(frozen=True, slots=True)
class Served:
    """One sequence the router finished: when, its shape, its time to first token, and
    the time from its first token to its last (``decode_s`` over ``osl - 1`` tokens)."""

    at: float
    shape: RequestShape
    ttft_s: float
    decode_s: float


@dataclass(frozen=True, slots=True)
class Observed:
    """Means over a window: TTFT of prompts long enough to be disaggregated (None: none
    was), ITL over every decoded token (None: none was)."""

    ttft_s: float | None
    itl_s: float | None


class DemandWindow:
    """The sequences the router finished over the last ``window_s``. Until the router has
    run that long, the rate is over the time it has run (a just-started router does not
    read its first minute as a quiet one). ``add`` runs on the router's event loop, the
    reads on the plan's thread: both under one lock, the reads on a copy."""

    def __init__(self, window_s: float, now: float) -> None:
        self.window_s = window_s
        self.started_at = now
        self._served: deque[Served] = deque()
        self._lock = threading.Lock()

    def add(
        self,
        now: float,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft_s: float = 0.0,
        decode_s: float = 0.0,
    ) -> None:
        if prompt_tokens < 1 or output_tokens < 1:
            return  # nothing to size (an echo, a failure before any token)
        cached = min(max(cached_tokens, 0), prompt_tokens - 1)
        shape = RequestShape(prompt_tokens, prompt_tokens - cached, output_tokens)
        with self._lock:
            self._served.append(Served(now, shape, ttft_s, decode_s))

    def _recent(self, now: float) -> list[Served]:
        with self._lock:
            while self._served and self._served[0].at < now - self.window_s:
                self._served.popleft()
            return list(self._served)

    def demand(self, now: float) -> Demand | None:
        """The window's rate and shapes; None while it holds no sequence."""
        served = self._recent(now)
        if not served:
            return None
        span_s = max(min(self.window_s, now - self.started_at), 1.0)
        return Demand(len(served) / span_s, tuple(s.shape for s in served[-MAX_SHAPES:]))

    def observed(self, now: float, min_disagg_tokens: int) -> Observed:
        served = self._recent(now)
        ttfts = [s.ttft_s for s in served if s.shape.uncached_tokens >= min_disagg_tokens]
        decode_s = sum(s.decode_s for s in served)
        decode_tokens = sum(s.shape.osl - 1 for s in served)
        return Observed(
            sum(ttfts) / len(ttfts) if ttfts else None,
            decode_s / decode_tokens if decode_tokens else None,
        )


def _solve(predicted: Callable[[float], float], seen: float) -> float | None:
    """The factor in ``CORRECTION_BOUNDS`` at which ``predicted`` (rising with the factor,
    infinite past a worker's capacity) equals ``seen``: bisected on its logarithm. None
    where the profile predicts nothing for the role (no disaggregated prompts: 0)."""
    low, high = CORRECTION_BOUNDS
    if predicted(low) <= 0:
        return None
    if predicted(low) >= seen:
        return low
    if predicted(high) <= seen:
        return high
    for _ in range(20):
        middle = math.sqrt(low * high)
        if predicted(middle) < seen:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


class LivePlan:
    """Sizes the window every ``interval_s`` and shows the answer in ``registry``.
    ``layout``: the workers of each role available now, (prefill, decode)."""

    def __init__(
        self,
        config: PlannerConfig,
        min_disagg_tokens: int,
        profile: Profile,
        registry: CollectorRegistry,
        layout: Callable[[], tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.profile = profile
        self.targets = Targets(config.ttft_ms / 1000, config.itl_ms / 1000,
                               config.max_utilization, min_disagg_tokens,
                               config.ttft_percentile, config.itl_percentile)  # fmt: skip
        self.layout = layout
        self.clock = clock
        self.window = DemandWindow(config.window_s, clock())
        self.correction = {Role.PREFILL: 1.0, Role.DECODE: 1.0}

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.replicas = gauge(
            "pdserve:planned_replicas",
            "Workers the role needs for the last planner.window_s of traffic.",
            "role",
        )
        self.rate = gauge(
            "pdserve:planned_demand_requests_per_second", "The request rate the plan sized."
        )
        self.ttft = gauge(
            "pdserve:planned_ttft_seconds",
            "TTFT predicted for the planned layout (disaggregated prompts; the target's "
            "statistic: a mean, or planner.ttft_percentile).",
        )
        self.itl = gauge("pdserve:planned_itl_seconds",
                         "ITL predicted for the layout (the target's statistic).")  # fmt: skip
        self.correction_gauge = gauge(
            "pdserve:planner_correction",
            "How much slower (> 1) the role's workers were seen than their profile.",
            "role",
        )
        self.last: Sizing | None = None
        self._task: asyncio.Task | None = None
        self._warned: set[str] = set()
        self.update()

    @classmethod
    def from_config(
        cls,
        config: PlannerConfig,
        min_disagg_tokens: int,
        registry: CollectorRegistry,
        layout: Callable[[], tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> LivePlan | None:
        """None without ``planner.profile``; raises ``ProfileError`` for a file that is not
        a profile (the router refuses to start on it, naming it)."""
        if config.profile is None:
            return None
        profile = read_profile(Path(config.profile))
        return cls(config, min_disagg_tokens, profile, registry, layout, clock)

    def sequence_served(
        self, prompt_tokens: int, cached_tokens: int, output_tokens: int, ttft_s: float,
        decode_s: float,
    ) -> None:  # fmt: skip
        self.window.add(self.clock(), prompt_tokens, cached_tokens, output_tokens, ttft_s,
                        decode_s)  # fmt: skip

    def update(self, layout: tuple[int, int] | None = None) -> Sizing:
        """Size the window now (corrected by what it saw, with ``planner.correct``, for
        ``layout``: the workers available, by default asked now); an empty window is sized
        as no load (one decode worker)."""
        now = self.clock()
        demand = self.window.demand(now)
        if demand is not None and self.config.correct:
            observed = self.window.observed(now, self.targets.min_disagg_tokens)
            self._correct(demand, observed, layout or self.layout())
        profile = scaled(self.profile, self.correction[Role.PREFILL], self.correction[Role.DECODE])
        sizing = size(profile, demand or Demand(0.0, (RequestShape(1, 1, 1),)), self.targets)
        self.replicas.labels(role=Role.PREFILL).set(sizing.prefill.replicas)
        self.replicas.labels(role=Role.DECODE).set(sizing.decode.replicas)
        self.rate.set(demand.rate_per_s if demand else 0.0)
        self.ttft.set(sizing.prefill.ttft_s)
        self.itl.set(sizing.decode.itl_s)
        for role, factor in self.correction.items():
            self.correction_gauge.labels(role=role).set(factor)
        for note in sizing.notes:
            # Once per kind: the plan repeats every interval. (Keyed by the text before
            # its first ":", the three "extrapolated beyond the profile" kinds were one.)
            if note.kind not in self._warned:
                self._warned.add(note.kind)
                logger.warning("live plan: %s", describe([note])[0])
        self.last = sizing
        return sizing

    def _correct(self, demand: Demand, observed: Observed, layout: tuple[int, int]) -> None:
        """Move each role's factor toward the one at which the profile predicts what was
        seen for the layout that served the window (the workers available now)."""
        num_prefill, num_decode = layout
        if num_decode < 1:
            return
        # A sample of the window's shapes is enough to calibrate by (the sizing takes all).
        # Means against means, whatever the targets: a window's mean is its steadiest
        # statistic, and the model's percentiles follow from the same corrected profile.
        step = max(1, len(demand.shapes) // CORRECTION_SHAPES)
        sample = Demand(demand.rate_per_s, demand.shapes[::step])
        means = self.targets.means()
        for role, seen in ((Role.PREFILL, observed.ttft_s), (Role.DECODE, observed.itl_s)):
            if seen is None or (role is Role.PREFILL and num_prefill < 1):
                continue

            def predicted(factor: float, role: Role = role) -> float:
                factors = (factor, 1.0) if role is Role.PREFILL else (1.0, factor)
                profile = scaled(self.profile, *factors)
                sizing = predict(profile, sample, means, num_prefill, num_decode)
                return sizing.prefill.ttft_s if role is Role.PREFILL else sizing.decode.itl_s

            factor = _solve(predicted, seen)
            if factor is not None:
                self.correction[role] = (1 - SMOOTHING) * self.correction[role] + SMOOTHING * factor

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:  # tens of ms of arithmetic: off the loop that streams tokens (the pool is
                # the loop's: read here)
                await asyncio.to_thread(self.update, self.layout())
            except Exception:
                logger.exception("live plan failed; the last plan stands")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
