"""The scheduler's waiting line: requests in ``Request.queue_order``, head first.

One order serves both policies. Under FCFS every priority is 0, so the order is arrival:
a preempted request (or one whose pull failed) goes back in ahead of everything that
arrived after it, and behind requests that arrived before it. Under the priority policy
lower values come first and arrival breaks ties. A sorted list, not a heap: the scheduler
walks it in order (skipping requests that wait for another's pull) and removes admitted
and aborted requests from anywhere in it; queues are hundreds long, where a list's O(n)
insert and removal cost less than a heap's bookkeeping.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from engine.request import Request


def queue_order(request: Request) -> tuple[int, int]:
    return request.queue_order


class RequestQueue:
    def __init__(self) -> None:
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def push(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=queue_order)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
