"""The router's live plan: the layout what it served lately needs (``planner.*`` config).

The router sees every sequence end: its prompt, how much of it a worker had cached and
how many tokens it generated. Those of the last ``window_s`` are a ``Demand`` (their rate
and shapes), sized every ``interval_s`` against the deployment's profile
(``planner/sizing.py``, the same model as ``pdserve plan size``); the answer is in the
router's metrics, for ``pdserve up --autoscale`` (``deploy/autoscale.py``), a Kubernetes
autoscaler or an operator:

* ``pdserve:planned_replicas{role}``: the workers each role needs;
* ``pdserve:planned_demand_requests_per_second``: the rate it was sized for;
* ``pdserve:planned_ttft_seconds`` and ``pdserve:planned_itl_seconds``: the means the
  planned layout is predicted to give.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from common.config import PlannerConfig
from planner.demand import Demand, RequestShape
from planner.profile_data import Profile, read_profile
from planner.sizing import Sizing, Targets, describe, size

logger = logging.getLogger(__name__)

MAX_SHAPES = 4096  # the most recent sequences a window keeps (its rate counts them all)


class DemandWindow:
    """The sequences the router finished over the last ``window_s``. Until the router has
    run that long, the rate is over the time it has run (a just-started router does not
    read its first minute as a quiet one)."""

    def __init__(self, window_s: float, now: float) -> None:
        self.window_s = window_s
        self.started_at = now
        self._ends: deque[float] = deque()
        self._shapes: deque[RequestShape] = deque(maxlen=MAX_SHAPES)

    def add(self, now: float, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        if prompt_tokens < 1 or output_tokens < 1:
            return  # nothing to size (an echo, a failure before any token)
        cached = min(max(cached_tokens, 0), prompt_tokens - 1)
        self._ends.append(now)
        self._shapes.append(RequestShape(prompt_tokens, prompt_tokens - cached, output_tokens))

    def demand(self, now: float) -> Demand | None:
        """The window's rate and shapes; None while it holds no sequence."""
        while self._ends and self._ends[0] < now - self.window_s:
            self._ends.popleft()
        num_shapes = min(len(self._ends), len(self._shapes))
        while len(self._shapes) > num_shapes:
            self._shapes.popleft()
        if not self._shapes:
            return None
        span_s = max(min(self.window_s, now - self.started_at), 1.0)
        return Demand(len(self._ends) / span_s, tuple(self._shapes))


class LivePlan:
    """Sizes the window every ``interval_s`` and shows the answer in ``registry``."""

    def __init__(
        self,
        config: PlannerConfig,
        min_disagg_tokens: int,
        profile: Profile,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.profile = profile
        self.targets = Targets(config.ttft_ms / 1000, config.itl_ms / 1000,
                               config.max_utilization, min_disagg_tokens)  # fmt: skip
        self.clock = clock
        self.window = DemandWindow(config.window_s, clock())
        self.replicas = Gauge("pdserve:planned_replicas", "Workers the role needs for the "
                              "last planner.window_s of traffic (planner.profile, targets).",
                              ["role"], registry=registry)  # fmt: skip
        self.rate = Gauge(
            "pdserve:planned_demand_requests_per_second",
            "The request rate the plan was sized for.",
            registry=registry,
        )
        self.ttft = Gauge("pdserve:planned_ttft_seconds", "Mean TTFT predicted for the planned "
                          "layout (disaggregated prompts).", registry=registry)  # fmt: skip
        self.itl = Gauge("pdserve:planned_itl_seconds", "Mean ITL predicted for the planned "
                         "layout.", registry=registry)  # fmt: skip
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
        clock: Callable[[], float] = time.monotonic,
    ) -> LivePlan | None:
        """None without ``planner.profile``; raises ``ProfileError`` for a file that is not
        a profile (the router refuses to start on it, naming it)."""
        if config.profile is None:
            return None
        profile = read_profile(Path(config.profile))
        return cls(config, min_disagg_tokens, profile, registry, clock)

    def sequence_served(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        self.window.add(self.clock(), prompt_tokens, cached_tokens, output_tokens)

    def update(self) -> Sizing:
        """Size the window now; an empty window is sized as no load (one decode worker)."""
        demand = self.window.demand(self.clock()) or Demand(0.0, (RequestShape(1, 1, 1),))
        sizing = size(self.profile, demand, self.targets)
        self.replicas.labels(role="prefill").set(sizing.prefill.replicas)
        self.replicas.labels(role="decode").set(sizing.decode.replicas)
        self.rate.set(demand.rate_per_s)
        self.ttft.set(sizing.prefill.ttft_s)
        self.itl.set(sizing.decode.itl_s)
        for warning in describe(sizing.notes):
            kind = warning.split(":", 1)[0]
            if kind not in self._warned:  # once per kind: the plan repeats every interval
                self._warned.add(kind)
                logger.warning("live plan: %s", warning)
        self.last = sizing
        return sizing

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.update()
            except Exception:
                logger.exception("live plan failed; the last plan stands")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
