"""A dependency's outage in the log: when it begins, a reminder while it lasts, and when
it ends. Said at every attempt, a registry down for half a minute wrote 30 identical
lines from the router and 15 from each worker, and its return went unsaid."""

from __future__ import annotations

import logging
import time

REMIND_S = 60.0  # how often an outage that lasts is said again


class OutageLog:
    """``failed`` after each failed attempt, ``succeeded`` after each good one (cheap
    when nothing changed). Not thread-safe: one caller's loop."""

    def __init__(self, logger: logging.Logger, what: str, remind_s: float = REMIND_S) -> None:
        self.logger, self.what, self.remind_s = logger, what, remind_s
        self._since: float | None = None  # when the outage began (time.monotonic)
        self._said_at = 0.0
        self.num_failures = 0

    def failed(self, error: BaseException | str) -> None:
        now = time.monotonic()
        self.num_failures += 1
        if self._since is None:
            self._since = self._said_at = now
            self.logger.warning("%s: %s", self.what, error)
        elif now - self._said_at >= self.remind_s:
            self._said_at = now
            self.logger.warning("%s for %.0f s (%d failures): %s", self.what,
                                now - self._since, self.num_failures, error)  # fmt: skip

    def succeeded(self) -> None:
        if self._since is not None:
            self.logger.info("%s: over after %.1f s (%d failures)", self.what,
                             time.monotonic() - self._since, self.num_failures)  # fmt: skip
            self._since = None
            self.num_failures = 0
