"""The waiting line keeps (priority, arrival) order whatever the order of pushes."""

from __future__ import annotations

import random

from engine.request_queue import RequestQueue
from tests.engine.test_scheduler import make_request


def test_order_is_priority_then_arrival():
    requests = []
    for index in range(40):
        request = make_request(f"r{index}", 3)
        request.priority, request.arrival_seq = random.Random(index).randint(-2, 2), index
        requests.append(request)
    queue = RequestQueue()
    for request in random.Random(0).sample(requests, len(requests)):
        queue.push(request)
    expected = sorted(requests, key=lambda r: (r.priority, r.arrival_seq))
    assert list(queue) == expected and len(queue) == 40
    queue.remove(expected[7])
    assert list(queue) == expected[:7] + expected[8:]
    for request in list(queue):
        queue.remove(request)
    assert not queue
