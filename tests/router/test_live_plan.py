"""The router's live plan: the window of sequences served, sized as ``pdserve plan size``
sizes a demand, shown in its metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.config import PlannerConfig
from planner.demand import Demand, RequestShape
from planner.profile_data import ProfileError, write_profile
from planner.sizing import Targets, size
from router.live_plan import DemandWindow, LivePlan
from tests.support.profiles import make_profile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_window_holds_the_last_window_s_of_sequences():
    window = DemandWindow(window_s=10.0, now=0.0)
    assert window.demand(0.0) is None
    window.add(1.0, 100, 40, 20)
    window.add(2.0, 100, 100, 20)  # all cached: the last token is still computed
    window.add(3.0, 50, 0, 0)  # no output: nothing to size
    demand = window.demand(4.0)
    assert demand.shapes == (RequestShape(100, 60, 20), RequestShape(100, 1, 20))
    assert demand.rate_per_s == pytest.approx(2 / 4.0)  # over the 4 s it has run
    window.add(15.0, 10, 0, 5)
    later = window.demand(15.0)
    assert later.shapes == (RequestShape(10, 10, 5),)  # 1 s and 2 s are out of the window
    assert later.rate_per_s == pytest.approx(1 / 10.0)


def test_the_plan_is_the_sizing_of_the_window_and_in_the_metrics(tmp_path):
    clock = Clock()
    registry = CollectorRegistry()
    config = PlannerConfig(profile=str(tmp_path / "p.json"), ttft_ms=3000, itl_ms=25,
                           window_s=10.0)  # fmt: skip
    write_profile(make_profile(), tmp_path / "p.json")
    plan = LivePlan.from_config(config, 256, registry, clock)
    idle = plan.last
    assert (idle.prefill.replicas, idle.decode.replicas) == (0, 1)
    clock.now += 10.0
    for _ in range(15):  # 1.5 prompts/s of 1000 tokens, 100 decode tokens each
        plan.sequence_served(1000, 0, 101)
    sizing = plan.update()
    expected = size(make_profile(), Demand(1.5, (RequestShape(1000, 1000, 101),)),
                    Targets(3.0, 0.025, 0.85, 256))  # fmt: skip
    assert sizing == expected
    assert (sizing.prefill.replicas, sizing.decode.replicas) == (2, 1)
    text = generate_latest(registry).decode()
    assert 'pdserve:planned_replicas{role="prefill"} 2.0' in text
    assert 'pdserve:planned_replicas{role="decode"} 1.0' in text
    assert "pdserve:planned_demand_requests_per_second 1.5" in text
    assert f"pdserve:planned_ttft_seconds {expected.prefill.ttft_s}" in text


def test_no_profile_no_plan_and_a_bad_one_is_named(tmp_path):
    assert LivePlan.from_config(PlannerConfig(), 256, CollectorRegistry()) is None
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ProfileError, match="is not a pdserve profile"):
        LivePlan.from_config(PlannerConfig(profile=str(bad)), 256, CollectorRegistry())
