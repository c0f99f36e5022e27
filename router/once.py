"""A call that acts at most once: the releases a sequence holds (its count on a worker, its
place ahead in a decode gate, its prefill lease) are ended from several paths (success,
failure, a client gone), and each must take effect exactly once."""

from __future__ import annotations

from collections.abc import Callable


def once(action: Callable[[], None]) -> Callable[[], None]:
    """``action``, run by the first call of the returned one; later calls do nothing."""
    pending = [True]

    def call() -> None:
        if pending:
            pending.clear()
            action()

    return call
