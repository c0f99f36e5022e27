"""Outcome bookkeeping: reported exactly once, waits bounded, releases wait for readers."""

from __future__ import annotations

import threading
import time

import pytest

from kv_transfer.errors import DuplicateTransferError, TransferFailedError
from kv_transfer.records import ExportRecord, FetchRecord, PeerRef
from kv_transfer.tracker import ExportTracker, FetchTracker


def fetch(tid: str, local: tuple[int, ...] | None = None) -> FetchRecord:
    """A fetch into ``local`` (default: a block of its own, by its id's first letter)."""
    local = (ord(tid[0]),) if local is None else local
    return FetchRecord(tid, PeerRef("p", "e"), (1,) * len(local), local, None,
                       time.monotonic() + 10)  # fmt: skip


def test_fetches_into_blocks_an_active_fetch_writes_are_refused():
    """Both would write the block, in either order, and both be reported done."""
    tracker = FetchTracker()
    tracker.add(fetch("a", (10, 11)))
    with pytest.raises(ValueError, match="an active fetch writes these blocks"):
        tracker.add(fetch("b", (11, 12)))
    tracker.add(fetch("c", (12, 13)))  # (the refused one took nothing)
    assert tracker.fail("a", TransferFailedError("gone"))
    tracker.add(fetch("d", (10, 11)))  # settled: its blocks are free again


def test_fetch_outcomes_are_reported_once():
    tracker = FetchTracker()
    for tid in ("a", "b", "c"):
        tracker.add(fetch(tid))
    with pytest.raises(DuplicateTransferError):
        tracker.add(fetch("a"))
    error = TransferFailedError("peer died")
    assert tracker.complete("a") and tracker.fail("b", error)
    assert not tracker.complete("a") and not tracker.fail("a", error)  # already settled
    results = tracker.drain()
    assert results.done == ["a"] and results.failed == {"b": error}
    assert not tracker.drain() and len(tracker) == 1


def test_wait_is_bounded_and_consumes():
    tracker = FetchTracker()
    tracker.add(fetch("a"))
    with pytest.raises(TimeoutError):
        tracker.wait("a", 0.01)
    threading.Timer(0.05, tracker.complete, args=("a",)).start()
    assert tracker.wait("a", 5) is None
    assert not tracker.drain()  # wait() consumed it
    with pytest.raises(KeyError):
        tracker.wait("a", 0)


def test_release_waits_for_readers_and_hides_the_export():
    tracker = ExportTracker()
    tracker.add(ExportRecord("x", (1, 2), None))
    released = threading.Event()
    with tracker.reading("x") as record:
        assert record is not None
        thread = threading.Thread(target=lambda: (tracker.release("x"), released.set()))
        thread.start()
        time.sleep(0.05)
        assert not released.is_set(), "release returned while a transport was reading"
    thread.join(5)
    assert released.is_set()
    with tracker.reading("x") as record:
        assert record is None
    assert not tracker.finish("x")  # a late notification does not resurrect it


def test_finished_exports_are_reported_once_then_forgotten():
    tracker = ExportTracker()
    tracker.add(ExportRecord("x", (1,), None))
    assert tracker.finish("x") and not tracker.finish("x")
    assert tracker.drain_finished() == ["x"]
    assert tracker.drain_finished() == [] and len(tracker) == 0


def test_a_late_fetch_fails_at_once_and_keeps_its_blocks_until_released():
    """Reported failed and late in one poll, released (once) in a later one; its blocks
    and its id stay taken until then."""
    tracker = FetchTracker()
    tracker.add(fetch("a", (10, 11)))
    assert tracker.fail_late("a", TransferFailedError("READ still running"))
    results = tracker.drain()
    assert list(results.failed) == ["a"] and results.late == {"a"} and not results.released
    with pytest.raises(ValueError, match="an active fetch writes these blocks"):
        tracker.add(fetch("b", (11,)))
    with pytest.raises(DuplicateTransferError):
        tracker.add(fetch("a", (20,)))
    assert tracker.late() == ["a"] and len(tracker) == 0
    assert tracker.release("a") and not tracker.release("a")
    results = tracker.drain()
    assert results.released == ["a"] and not results.failed and not results.late
    assert not tracker.drain()
    tracker.add(fetch("b", (10, 11)))  # released: its blocks are free again
