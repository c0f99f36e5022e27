"""The router's live plan: the window of sequences served, sized as ``pdserve plan size``
sizes a demand, shown in its metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.config import PlannerConfig
from planner.demand import Demand, RequestShape
from planner.profile_data import ProfileError, scaled, write_profile
from planner.sizing import Targets, predict, size
from router.live_plan import DemandWindow, LivePlan
from tests.support.clock import ManualClock
from tests.support.profiles import make_profile


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
    clock = ManualClock()
    registry = CollectorRegistry()
    config = PlannerConfig(profile=str(tmp_path / "p.json"), ttft_ms=3000, itl_ms=25,
                           window_s=10.0, correct=False)  # fmt: skip
    write_profile(make_profile(), tmp_path / "p.json")
    plan = LivePlan.from_config(config, 256, registry, lambda: (2, 1), clock)
    idle = plan.last
    assert (idle.prefill.replicas, idle.decode.replicas) == (0, 1)
    clock.now += 10.0
    for _ in range(15):  # 1.5 prompts/s of 1000 tokens, 100 decode tokens each
        plan.sequence_served(1000, 0, 101, 1.0, 2.0)
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
    assert LivePlan.from_config(PlannerConfig(), 256, CollectorRegistry(), lambda: (1, 1)) is None
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ProfileError, match="is not a pdserve profile"):
        LivePlan.from_config(PlannerConfig(profile=str(bad)), 256, CollectorRegistry(),
                             lambda: (1, 1))  # fmt: skip


def corrected_plan(tmp_path, correct: bool = True) -> tuple[LivePlan, ManualClock]:
    clock = ManualClock()
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_profile(make_profile(), tmp_path / "p.json")
    config = PlannerConfig(profile=str(tmp_path / "p.json"), ttft_ms=10_000, itl_ms=25,
                           window_s=10.0, correct=correct)  # fmt: skip
    return LivePlan.from_config(config, 256, CollectorRegistry(), lambda: (8, 1), clock), clock


def serve(plan: LivePlan, clock: ManualClock, itl_s: float) -> None:
    """5 requests/s for 10 s of 1000-token prompts and 101 tokens, at ``itl_s`` (the
    last call's sequences out of the window by then)."""
    clock.now += 10.5
    for _ in range(50):
        plan.sequence_served(1000, 0, 101, 0.5, 100 * itl_s)


def test_workers_seen_slower_than_their_profile_correct_it(tmp_path):
    """The profile says one worker decodes 500 tokens/s at a mean ITL of 0.011 / (1 -
    0.001 * 500) = 22 ms (``tests/planner/test_sizing.py``). Seen at 40 ms: the profile
    predicts that with its steps ``f`` times as long, 0.011 f / (1 - 0.5 f) = 0.04 at f =
    40 / 31, and the factor moves halfway there (71 / 62). One worker would then see 29.5
    ms, over the 25 ms target: two are planned (17.6 ms)."""
    plain, plain_clock = corrected_plan(tmp_path / "a", correct=False)
    serve(plain, plain_clock, itl_s=0.040)
    assert plain.update().decode.replicas == 1
    plan, clock = corrected_plan(tmp_path / "b")
    serve(plan, clock, itl_s=0.040)
    sizing = plan.update()
    factor = 71 / 62
    assert plan.correction["decode"] == pytest.approx(factor, rel=1e-4)
    assert sizing.decode.replicas == 2
    assert sizing.decode.itl_s == pytest.approx(0.011 * factor / (1 - 0.25 * factor), rel=1e-3)
    serve(plan, clock, itl_s=0.040)
    plan.update()
    assert plan.correction["decode"] == pytest.approx((factor + 40 / 31) / 2, rel=1e-4)
    # Disaggregated prompts were seen at 0.5 s against over 1 s predicted (8 prefill
    # workers serve it): faster.
    assert plan.correction["prefill"] < 1


def test_percentile_targets_plan_for_the_tail_corrected_on_the_means(tmp_path):
    """The same window as above under a p99 ITL target: the factor is solved on the
    window's mean, as before (71 / 62); the layout is sized for the tail, which needs
    more decode workers than the mean did, and the gauge shows the p99."""
    clock = ManualClock()
    write_profile(make_profile(), tmp_path / "p.json")
    config = PlannerConfig(profile=str(tmp_path / "p.json"), ttft_ms=10_000, itl_ms=25,
                           itl_percentile=99, window_s=10.0)  # fmt: skip
    registry = CollectorRegistry()
    plan = LivePlan.from_config(config, 256, registry, lambda: (8, 1), clock)
    serve(plan, clock, itl_s=0.040)
    sizing = plan.update()
    assert plan.correction["decode"] == pytest.approx(71 / 62, rel=1e-4)
    assert sizing.decode.replicas == 3 and sizing.decode.itl_s <= 0.025
    one_fewer = predict(scaled(make_profile(), 1.0, 71 / 62), Demand(5.0, (RequestShape(
        1000, 1000, 101),)), plan.targets, 8, 2)  # fmt: skip
    assert one_fewer.decode.itl_s > 0.025 > 0.011 * (71 / 62) / (1 - 0.25 * 71 / 62)
    text = generate_latest(registry).decode()
    assert f"pdserve:planned_itl_seconds {sizing.decode.itl_s}" in text


def test_the_factor_stays_within_what_the_load_allows_and_its_bounds(tmp_path):
    """Seen at 2 s a token: the profile can only predict that near saturation (its steps
    just under twice as long: 0.011 f / (1 - 0.5 f) = 2 at f = 1.978, halfway there from 1
    is 1.489). Seen at 0.1 ms:
    the lower bound, 0.25."""
    plan, clock = corrected_plan(tmp_path / "a")
    serve(plan, clock, itl_s=2.0)
    plan.update()
    assert 1.45 < plan.correction["decode"] < 1.5
    fast, fast_clock = corrected_plan(tmp_path / "b")
    serve(fast, fast_clock, itl_s=0.0001)
    fast.update()
    assert fast.correction["decode"] == pytest.approx(0.5 + 0.5 * 0.25)


def test_each_kind_of_warning_is_logged_once(tmp_path, caplog):
    """Keyed by the text before its first ":", the three "extrapolated beyond the
    profile" notes were one kind: a long decode context after long prompts was never
    logged."""
    clock = ManualClock()
    config = PlannerConfig(profile=str(tmp_path / "p.json"), correct=False)
    write_profile(make_profile(), tmp_path / "p.json")
    plan = LivePlan.from_config(config, 256, CollectorRegistry(), lambda: (1, 1), clock)
    with caplog.at_level("WARNING", logger="router.live_plan"):
        clock.now += 1.0
        for _ in range(10):  # prompts past the profile's longest (10,000 tokens)
            plan.sequence_served(12_000, 0, 2, 0.1, 0.01)
        plan.update((1, 1))
        clock.now += 200.0
        for _ in range(10):  # short prompts, a decode context past the profile's
            plan.sequence_served(300, 0, 30_000, 0.1, 0.01)
        assert [n.kind for n in plan.update((1, 1)).notes] == ["context"]
        plan.update((1, 1))  # the same again: not logged twice
    logged = [r.getMessage() for r in caplog.records]
    assert sum("prompts of 12000 tokens" in m for m in logged) == 1
    assert sum("mean decode context" in m for m in logged) == 1, logged
