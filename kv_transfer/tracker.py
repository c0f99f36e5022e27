"""Thread-safe bookkeeping shared by every connector: active fetches and exports.

Transports run their work on background threads and report here; the engine thread drains
results without blocking. Keeping this in one place gives every transport the same
semantics: an outcome is reported exactly once, and an unknown or released transfer id is
ignored rather than resurrected.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kv_transfer.errors import DuplicateTransferError, KVTransferError
from kv_transfer.records import ExportRecord, FetchRecord, FetchResults


class FetchTracker:
    """Active fetches and their outcomes, waiting to be collected."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[str, FetchRecord] = {}
        self._outcomes: dict[str, KVTransferError | None] = {}  # None: done
        self._aborted: set[str] = set()  # active fetches the fetcher gave up
        self._writing: set[int] = set()  # local block ids active (or late) fetches write
        # Failed, but a write into their blocks may still run: until ``release``.
        self._late: dict[str, FetchRecord] = {}
        self._late_failed: set[str] = set()  # late ids whose failure is not drained yet
        self._released: list[str] = []  # late ids released, not drained yet

    def add(self, record: FetchRecord) -> None:
        """Raises ``DuplicateTransferError`` for an active id, ``ValueError`` for local
        blocks an active fetch writes: both would be written, in either order, and both
        reported done (a caller's bug, refused rather than silent)."""
        with self._cond:
            tid = record.transfer_id
            if tid in self._active or tid in self._outcomes or tid in self._late:
                raise DuplicateTransferError(tid)
            if not self._writing.isdisjoint(record.local_block_ids):
                raise ValueError("start_fetch local: an active fetch writes these blocks")
            self._active[tid] = record
            self._writing.update(record.local_block_ids)

    def complete(self, transfer_id: str) -> bool:
        return self._settle(transfer_id, None)

    def fail(self, transfer_id: str, error: KVTransferError) -> bool:
        return self._settle(transfer_id, error)

    def fail_late(self, transfer_id: str, error: KVTransferError) -> bool:
        """Fail a fetch whose local blocks may still be written (a READ that cannot be
        cancelled): reported failed and late now, its blocks stay marked written until
        ``release``. False if the transfer was not active."""
        return self._settle(transfer_id, error, late=True)

    def release(self, transfer_id: str) -> bool:
        """A late fetch's write has ended: its blocks are free to reuse, and the id comes
        back once in ``released``. False if it was not late (or released already)."""
        with self._cond:
            record = self._late.pop(transfer_id, None)
            if record is None:
                return False
            self._writing.difference_update(record.local_block_ids)
            self._released.append(transfer_id)
            self._cond.notify_all()
            return True

    def late(self) -> list[str]:
        """Late fetches not released yet."""
        with self._cond:
            return list(self._late)

    def _settle(self, transfer_id: str, error: KVTransferError | None, late: bool = False) -> bool:
        """Record an outcome; False if the transfer was not active (already settled)."""
        with self._cond:
            record = self._active.pop(transfer_id, None)
            if record is None:
                return False
            if late:
                self._late[transfer_id] = record
                self._late_failed.add(transfer_id)
            else:
                self._writing.difference_update(record.local_block_ids)
            self._aborted.discard(transfer_id)
            self._outcomes[transfer_id] = error
            self._cond.notify_all()
            return True

    def abort(self, transfer_id: str) -> bool:
        """Mark an active fetch given up; False if it is not active."""
        with self._cond:
            if transfer_id not in self._active:
                return False
            self._aborted.add(transfer_id)
            return True

    def is_aborted(self, transfer_id: str) -> bool:
        with self._cond:
            return transfer_id in self._aborted

    def active(self) -> list[FetchRecord]:
        with self._cond:
            return list(self._active.values())

    def drain(self) -> FetchResults:
        with self._cond:
            results = FetchResults()
            for tid, error in self._outcomes.items():
                if error is None:
                    results.done.append(tid)
                else:
                    results.failed[tid] = error
            self._outcomes.clear()
            results.late, self._late_failed = self._late_failed, set()
            results.released, self._released = self._released, []
            return results

    def wait(self, transfer_id: str, timeout_s: float | None) -> KVTransferError | None:
        """Block until the transfer settles; return (and consume) its error, None if done.

        Raises ``TimeoutError`` if it is still running after ``timeout_s`` and ``KeyError``
        if the id is neither active nor waiting to be collected.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while transfer_id not in self._outcomes:
                if transfer_id not in self._active:
                    raise KeyError(f"no fetch {transfer_id!r} to wait for")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"fetch {transfer_id!r} still running")
                self._cond.wait(remaining)
            self._late_failed.discard(transfer_id)  # (still late: ``release`` reports it)
            return self._outcomes.pop(transfer_id)

    def __len__(self) -> int:
        with self._cond:
            return len(self._active)


class ExportTracker:
    """Exported transfers, from ``export_blocks`` until reported finished or released.

    Transports read exported blocks only inside ``reading()``; ``drain_finished`` and
    ``release`` wait for readers to leave, so once either has returned a transfer id the
    connector never touches those blocks again and the caller may reuse them.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[str, ExportRecord] = {}
        self._finished: list[str] = []
        self._readers: dict[str, int] = {}

    def add(self, record: ExportRecord) -> None:
        with self._cond:
            if record.transfer_id in self._active:
                raise DuplicateTransferError(record.transfer_id)
            self._active[record.transfer_id] = record

    def get(self, transfer_id: str) -> ExportRecord | None:
        with self._cond:
            return self._active.get(transfer_id)

    @contextmanager
    def reading(self, transfer_id: str) -> Iterator[ExportRecord | None]:
        """Hold the export's blocks while reading them; yields None if it was released."""
        with self._cond:
            record = self._active.get(transfer_id)
            if record is not None:
                self._readers[transfer_id] = self._readers.get(transfer_id, 0) + 1
        try:
            yield record
        finally:
            if record is not None:
                with self._cond:
                    self._readers[transfer_id] -= 1
                    if not self._readers[transfer_id]:
                        del self._readers[transfer_id]
                    self._cond.notify_all()

    def finish(self, transfer_id: str) -> bool:
        """Mark an export finished (reported once by ``drain_finished``); False if unknown."""
        with self._cond:
            if transfer_id not in self._active or transfer_id in self._finished:
                return False
            self._finished.append(transfer_id)
            return True

    def drain_finished(self) -> list[str]:
        """The exports finished since the last call, now forgotten."""
        with self._cond:
            finished, self._finished = self._finished, []
            for transfer_id in finished:
                self._forget(transfer_id)
            return finished

    def release(self, transfer_id: str) -> None:
        """Forget the export (finished or not); a no-op for an unknown id."""
        with self._cond:
            if transfer_id in self._finished:
                self._finished.remove(transfer_id)
            self._forget(transfer_id)

    def _forget(self, transfer_id: str) -> None:
        # Caller holds the lock. New readers see None from here on; wait out current ones.
        self._active.pop(transfer_id, None)
        while self._readers.get(transfer_id):
            self._cond.wait()

    def __len__(self) -> int:
        with self._cond:
            return len(self._active)
