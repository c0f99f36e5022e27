"""The waiter hands each item on once ready, fails it when its check raises or its
deadline passes, and fails what still waits when closed; every item settles once."""

from __future__ import annotations

import threading
import time

import pytest

from kv_transfer.errors import TransferFailedError
from kv_transfer.file_waiter import FileWaiter


class Outcomes:
    """Each item's outcomes, by name: ["go"] or [error type name]."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}
        self._cond = threading.Condition()

    def go(self, name: str):
        return lambda: self._record(name, "go")

    def fail(self, name: str):
        return lambda error: self._record(name, type(error).__name__)

    def _record(self, name: str, outcome: str) -> None:
        with self._cond:
            self.seen.setdefault(name, []).append(outcome)
            self._cond.notify_all()

    def wait_for(self, names: list[str], timeout_s: float = 10.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: all(n in self.seen for n in names), timeout_s)


@pytest.mark.timeout(30)
def test_items_go_once_ready_and_fail_on_a_raise_or_their_deadline():
    waiter = FileWaiter("test-waiter", max_poll_s=0.01)
    outcomes = Outcomes()
    ready_at = time.monotonic() + 0.3
    calls = {"later": 0}

    def later() -> bool:
        calls["later"] += 1
        return time.monotonic() >= ready_at

    def broken() -> bool:
        raise TransferFailedError("marker found")

    def crashes() -> bool:
        raise OSError("stat failed")

    far = time.monotonic() + 20
    try:
        waiter.add(lambda: True, outcomes.go("now"), outcomes.fail("now"), far)
        waiter.add(later, outcomes.go("later"), outcomes.fail("later"), far)
        waiter.add(broken, outcomes.go("broken"), outcomes.fail("broken"), far)
        waiter.add(crashes, outcomes.go("crashes"), outcomes.fail("crashes"), far)
        started = time.monotonic()
        waiter.add(lambda: False, outcomes.go("never"), outcomes.fail("never"), started + 0.5)
        outcomes.wait_for(["now", "later", "broken", "crashes", "never"])
        assert time.monotonic() - started >= 0.5  # not failed before its deadline
        assert outcomes.seen == {
            "now": ["go"],
            "later": ["go"],
            "broken": ["TransferFailedError"],
            "crashes": ["TransferFailedError"],
            "never": ["BlockNotFoundError"],
        }
        assert 3 <= calls["later"] <= 100  # re-checked on a backoff, not spun on
    finally:
        waiter.close()


@pytest.mark.timeout(30)
def test_close_fails_what_waits_and_what_comes_after():
    waiter = FileWaiter("test-waiter", max_poll_s=0.01)
    outcomes = Outcomes()
    far = time.monotonic() + 20
    waiter.add(lambda: False, outcomes.go("waiting"), outcomes.fail("waiting"), far)
    time.sleep(0.05)
    waiter.close()
    waiter.add(lambda: True, outcomes.go("late"), outcomes.fail("late"), far)
    assert outcomes.seen == {"waiting": ["ConnectorClosedError"], "late": ["ConnectorClosedError"]}


@pytest.mark.timeout(30)
def test_an_item_that_cannot_be_handed_on_still_settles():
    waiter = FileWaiter("test-waiter", max_poll_s=0.01)
    outcomes = Outcomes()

    def go() -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")

    try:
        waiter.add(lambda: True, go, outcomes.fail("refused"), time.monotonic() + 20)
        waiter.add(lambda: True, outcomes.go("next"), outcomes.fail("next"), time.monotonic() + 20)
        outcomes.wait_for(["refused", "next"])
        assert outcomes.seen == {"refused": ["TransferFailedError"], "next": ["go"]}
    finally:
        waiter.close()
