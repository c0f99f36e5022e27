"""Demands: shapes checked, a trace's requests cut into windows."""

from __future__ import annotations

import pytest

from planner.demand import Demand, RequestShape, TimedRequest, windows


def test_windows_hold_their_requests_over_their_length():
    shape = RequestShape(10, 10, 10)
    at = [0.0, 1.0, 2.0, 65.0, 150.0, 155.0]
    demands = windows([TimedRequest(t, shape) for t in at], 60.0)
    assert [(d.start_s, len(d.shapes)) for d in demands] == [(0.0, 3), (60.0, 1), (120.0, 2)]
    assert demands[0].rate_per_s == pytest.approx(3 / 60)
    assert demands[2].rate_per_s == pytest.approx(2 / 60)  # a whole window, not 35 s
    single = windows([TimedRequest(t, shape) for t in (0.0, 0.25)], 60.0)
    assert single[0].rate_per_s == pytest.approx(2.0)  # at least a second long
    lone = windows([TimedRequest(t, shape) for t in (0.0, 40.0)], 60.0)
    assert lone[0].rate_per_s == pytest.approx(2 / 40)  # as long as the trace


def test_a_steady_load_is_steady_in_every_window():
    """1 request a second for 62 s: the 2 s tail (60 and 61 s) read 2/s, twice the load,
    and sized the layout."""
    steady = windows([TimedRequest(float(t), RequestShape(10, 10, 10)) for t in range(62)], 60)
    assert max(d.rate_per_s for d in steady) == pytest.approx(1.0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="uncached_tokens"):
        RequestShape(10, 11, 1)
    with pytest.raises(ValueError, match="osl"):
        RequestShape(10, 10, 0)
    with pytest.raises(ValueError, match="rate"):
        Demand(-1.0, (RequestShape(1, 1, 1),))
