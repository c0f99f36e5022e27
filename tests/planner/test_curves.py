"""A profile's points as functions: exact at the points, linear between, extended only
where the cost rises."""

from __future__ import annotations

import pytest

from planner.curves import DecodeCurve, PrefillCurve
from planner.profile_data import DecodePoint, PrefillPoint


def test_prefill_per_token_time_is_linear_between_points_and_extends_its_rise():
    curve = PrefillCurve([PrefillPoint(1000, 0.5, 2000.0), PrefillPoint(100, 0.05, 4000.0)])
    assert curve.token_s(100) == pytest.approx(1 / 4000)
    assert curve.token_s(1000) == pytest.approx(1 / 2000)
    assert curve.token_s(550) == pytest.approx((1 / 4000 + 1 / 2000) / 2)
    assert curve.token_s(10) == pytest.approx(1 / 4000)  # below: the shortest's
    # Beyond: per-token time keeps rising as it did (attention over a longer prompt).
    assert curve.token_s(1900) == pytest.approx(1 / 2000 + (1 / 2000 - 1 / 4000))
    assert curve.latency_s(550) == pytest.approx(0.275)
    assert curve.max_isl == 1000


def test_a_cost_that_falls_with_size_is_not_extended_into_a_fall():
    curve = PrefillCurve([PrefillPoint(100, 0.1, 1000.0), PrefillPoint(200, 0.1, 4000.0)])
    assert curve.token_s(10_000) == pytest.approx(1 / 4000)


def test_decode_step_time_is_bilinear_on_the_grid():
    points = [
        DecodePoint(1, 1000, 0.010), DecodePoint(8, 1000, 0.020),
        DecodePoint(1, 3000, 0.012), DecodePoint(8, 3000, 0.036),
    ]  # fmt: skip
    curve = DecodeCurve(points)
    assert curve.itl_s(1, 1000) == pytest.approx(0.010)
    assert curve.itl_s(8, 3000) == pytest.approx(0.036)
    assert curve.itl_s(4.5, 1000) == pytest.approx(0.015)
    assert curve.itl_s(4.5, 2000) == pytest.approx((0.015 + 0.024) / 2)
    assert curve.itl_s(0.5, 1000) == pytest.approx(0.010)  # a fraction of a request: a step
    assert curve.itl_s(1, 500) == pytest.approx(0.010)  # shorter contexts: the shortest's
    assert curve.itl_s(8, 5000) == pytest.approx(0.036 + 0.016)  # KV reads keep growing
    assert curve.itl_s(15, 1000) == pytest.approx(0.030)
    assert (curve.max_batch_at(2000), curve.max_context) == (8, 3000)


def test_each_context_keeps_the_largest_batch_measured_there():
    """The profiler leaves out batches whose KV does not fit at long contexts: a short
    context measured to 32 is not held to the long one's 8."""
    points = [DecodePoint(b, 256, 0.010 + 0.001 * b) for b in (1, 8, 32)]
    points += [DecodePoint(b, 2048, 0.012 + 0.002 * b) for b in (1, 8)]
    curve = DecodeCurve(points)
    assert [curve.max_batch_at(c) for c in (100, 256, 1000, 2048, 4096)] == [32, 32, 8, 8, 8]


def test_repeated_points_are_refused():
    with pytest.raises(ValueError, match="repeat a prompt length"):
        PrefillCurve([PrefillPoint(100, 0.1, 1.0), PrefillPoint(100, 0.2, 1.0)])
    with pytest.raises(ValueError, match="repeat a batch"):
        DecodeCurve([DecodePoint(1, 100, 0.1), DecodePoint(1, 100, 0.2)])
