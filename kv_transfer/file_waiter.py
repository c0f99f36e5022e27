"""One thread that holds work until what it needs exists, so that no I/O thread sleeps.

The shared-storage fetcher needs block files an exporter is still writing, or may never
write (it froze, it died). Waiting for them on the I/O threads let two such chunks hold
both threads until their deadline, and every other fetch, its files long on disk, queued
behind them past its own deadline. Here each waiting item is re-checked on its own
backoff schedule, and handed on (``go``) once ready, or failed (``fail``) when its check
raises or its deadline passes. Checks run on this thread, one at a time: they must be
cheap (a few ``stat`` calls), never a blocking wait.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.errors import (
    BlockNotFoundError,
    ConnectorClosedError,
    KVTransferError,
    TransferFailedError,
)

logger = logging.getLogger(__name__)

_FIRST_POLL_S = 0.001


@dataclass(slots=True)
class _Waiting:
    ready: Callable[[], bool]  # True once it can go; raises KVTransferError to fail it
    go: Callable[[], None]
    fail: Callable[[KVTransferError], None]
    deadline: float  # time.monotonic()
    delay_s: float = _FIRST_POLL_S


class FileWaiter:
    def __init__(self, name: str, max_poll_s: float) -> None:
        self._max_poll_s = max_poll_s
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, _Waiting]] = []  # a heap by next check time
        self._order = itertools.count()  # ties: first added, first checked
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(
        self,
        ready: Callable[[], bool],
        go: Callable[[], None],
        fail: Callable[[KVTransferError], None],
        deadline: float,
    ) -> None:
        """Check ``ready`` now and then until it is True (then ``go``), raises or
        ``deadline`` passes (then ``fail``). ``go`` and ``fail`` run on the waiter's
        thread: they must only hand the item on."""
        waiting = _Waiting(ready, go, fail, deadline)
        with self._cond:
            if not self._closed:
                heapq.heappush(self._due, (0.0, next(self._order), waiting))
                self._cond.notify()
                return
        fail(ConnectorClosedError("connector closed"))

    def close(self) -> None:
        """Fail what still waits and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while (batch := self._next_due()) is not None:
            for waiting in batch:
                self._check(waiting)
        with self._cond:
            left, self._due = self._due, []
        for _, _, waiting in left:
            waiting.fail(ConnectorClosedError("connector closed"))

    def _next_due(self) -> list[_Waiting] | None:
        """The items due for a check, once there are any; None once closed."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                if self._due and self._due[0][0] <= now:
                    batch = []
                    while self._due and self._due[0][0] <= now:
                        batch.append(heapq.heappop(self._due)[2])
                    return batch
                self._cond.wait(self._due[0][0] - now if self._due else None)
            return None

    def _check(self, waiting: _Waiting) -> None:
        try:
            ready = waiting.ready()
            if not ready and time.monotonic() >= waiting.deadline:
                raise BlockNotFoundError("not there within the timeout")
        except KVTransferError as exc:
            waiting.fail(exc)
            return
        except Exception as exc:
            logger.exception("a wait's check failed")
            waiting.fail(TransferFailedError(f"{type(exc).__name__}: {exc}"))
            return
        if ready:
            try:
                waiting.go()
            except Exception as exc:  # it could not be handed on: it must still settle
                logger.exception("handing a wait on failed")
                waiting.fail(TransferFailedError(f"{type(exc).__name__}: {exc}"))
            return
        due = min(time.monotonic() + waiting.delay_s, waiting.deadline)
        waiting.delay_s = min(2 * waiting.delay_s, self._max_poll_s)
        with self._cond:
            if not self._closed:
                heapq.heappush(self._due, (due, next(self._order), waiting))
                return
        waiting.fail(ConnectorClosedError("connector closed"))
