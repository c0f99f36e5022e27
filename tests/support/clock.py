"""A clock a test moves by hand (``clock.now += 10``), for code that takes one
(``clock: Callable[[], float]``)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
