"""Waiting in tests for a condition, rather than sleeping for a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(
    condition: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05
) -> bool:
    """Whether ``condition`` held within ``timeout_s``, checked every ``interval_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
