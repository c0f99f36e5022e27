"""A prefix's recent uses: what placement spreads the cost of moving it over."""

from __future__ import annotations

import math

import pytest

from router.prefix_demand import PrefixDemand
from router.prefix_index import PrefixMatch
from tests.support.clock import ManualClock


def test_uses_add_up_and_decay_over_the_window():
    clock = ManualClock(100.0)
    demand = PrefixDemand(window_s=30.0, clock=clock)
    assert [demand.use(b"a") for _ in range(3)] == [1.0, 2.0, 3.0]
    clock.now += 30.0
    assert demand.use(b"a") == pytest.approx(3 / math.e + 1)
    assert demand.use(b"b") == 1.0  # each prefix its own
    clock.now += 3000.0
    assert demand.use(b"a") == pytest.approx(1.0)  # long unused: as new


def test_a_look_counts_no_use():
    """A prompt's later samples (n > 1) read its uses without adding one."""
    clock = ManualClock(100.0)
    demand = PrefixDemand(window_s=30.0, clock=clock)
    assert demand.use(b"a", count=False) == 1.0 and len(demand) == 0  # (at least one)
    assert [demand.use(b"a") for _ in range(3)] == [1.0, 2.0, 3.0]
    clock.now += 30.0
    assert demand.use(b"a", count=False) == pytest.approx(3 / math.e)
    assert demand.use(b"a", count=False) == pytest.approx(3 / math.e)
    assert demand.use(b"a") == pytest.approx(3 / math.e + 1)


def test_the_least_recently_used_prefix_goes_first_past_the_capacity():
    demand = PrefixDemand(window_s=30.0, capacity=2, clock=ManualClock(100.0))
    demand.use(b"a")
    demand.use(b"b")
    demand.use(b"a")  # a is the most recent now
    demand.use(b"c")  # b goes
    assert len(demand) == 2
    assert demand.use(b"a") == 3.0 and demand.use(b"b") == 1.0


def test_no_window_counts_every_use_as_one():
    demand = PrefixDemand(window_s=0.0)
    assert [demand.use(b"a") for _ in range(3)] == [1.0, 1.0, 1.0] and len(demand) == 0


def test_a_prompt_counts_a_use_of_the_deepest_prefix_any_worker_matched():
    demand = PrefixDemand(window_s=30.0, clock=ManualClock(100.0))
    hashes = [b"a", b"b", b"c"]
    assert demand.use_deepest(hashes, [PrefixMatch(1, 0), PrefixMatch(0, 2)]) == 1.0
    assert demand.use_deepest(hashes[:2], [PrefixMatch(2, 0)]) == 2.0  # the same prefix, b
    assert demand.use_deepest(hashes, []) == 1.0 and len(demand) == 1  # nothing matched
