"""``pdserve up``'s autoscaler (``planner.autoscale``): it follows the router's live plan.

The router sizes what it served lately (``router/live_plan.py``) and shows the workers
each role needs as ``pdserve:planned_replicas{role}``; every ``planner.interval_s`` the
launcher reads that and starts or drains workers of the config's static list, between
``planner.min_<role>_replicas`` and the role's ``replicas``. Up at once (a worker takes its
model's load time to help); down one worker at a time, each after the lower plan has held
``planner.scale_in_delay_s`` (a lull between bursts must not drain what the next burst
needs). A drained worker finishes its requests and exits 0, as on any SIGTERM.
"""

from __future__ import annotations

import re

from common.config import PdserveConfig, Role
from common.prometheus_text import fetch

_PLANNED = re.compile(r'^pdserve:planned_replicas\{role="(prefill|decode)"\} (\S+)$', re.M)


def planned_replicas(metrics_text: str) -> dict[Role, int]:
    """The router's plan from its /metrics text; empty while it has none."""
    return {Role(role): round(float(value)) for role, value in _PLANNED.findall(metrics_text)}


def read_plan(metrics_url: str) -> dict[Role, int]:
    text = fetch(metrics_url, timeout_s=2.0)
    return {} if text is None else planned_replicas(text)  # none: keep what runs


class Autoscaler:
    """How many workers of each role to run, given the plan and what runs. Pure: the clock
    comes in, so its timing is tested without waiting."""

    def __init__(self, config: PdserveConfig) -> None:
        planner = config.planner
        self.scale_in_delay_s = planner.scale_in_delay_s
        self.bounds = {
            Role.PREFILL: (planner.min_prefill_replicas, config.prefill.replicas),
            Role.DECODE: (planner.min_decode_replicas, config.decode.replicas),
        }
        self._lower_since: dict[Role, float] = {}

    def initial(self, role: Role) -> int:
        """Workers to start with: the role's minimum (the plan raises it as traffic comes)."""
        return self.bounds[role][0]

    def target(self, role: Role, planned: int | None, running: int, now: float) -> int:
        """Workers of ``role`` to run from now: ``planned`` within the bounds, at once if
        higher; one fewer than ``running`` once a lower plan has held the delay (the delay
        starts over after each drain). None (no plan yet): the bounds only."""
        least, most = self.bounds[role]
        wanted = min(max(running if planned is None else planned, least), most)
        if wanted >= running:
            self._lower_since.pop(role, None)
            return wanted
        since = self._lower_since.setdefault(role, now)
        if now - since < self.scale_in_delay_s:
            return running
        del self._lower_since[role]
        return running - 1
