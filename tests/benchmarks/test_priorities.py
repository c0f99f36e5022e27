"""``--priority-mix``: parsing, refusals, and each session's class drawn reproducibly in
the mix's proportions."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.loadgen.client import BenchClient
from benchmarks.loadgen.priorities import PriorityMix


def test_parse_and_draw():
    mix = PriorityMix.parse("0:1, 1:3", seed=5)
    assert mix.weights == ((0, 1.0), (1, 3.0)) and str(mix) == "0:1,1:3"
    assert PriorityMix.parse("-2,7").weights == ((-2, 1.0), (7, 1.0))
    classes = Counter(mix.of(session) for session in range(4000))
    assert set(classes) == {0, 1} and 0.2 < classes[0] / 4000 < 0.3
    assert [mix.of(s) for s in range(50)] == [PriorityMix.parse("0:1,1:3", 5).of(s)
                                              for s in range(50)]  # fmt: skip
    assert [mix.of(s) for s in range(50)] != [PriorityMix.parse("0:1,1:3", 6).of(s)
                                              for s in range(50)]  # fmt: skip


@pytest.mark.parametrize("text", ["", "a:1", "0:x", "0:1,0:2", "0:0", "0:-1", f"{2**31}:1"])
def test_bad_mixes_are_refused(text):
    with pytest.raises(ValueError):
        PriorityMix.parse(text)


def test_the_client_sends_a_priority_only_when_it_has_one():
    client = BenchClient("http://h:1/v1", "m")
    assert "priority" not in client.body([1, 2], 4)
    assert client.body([1, 2], 4, priority=0)["priority"] == 0
