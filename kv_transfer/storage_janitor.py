"""Keeping the shared-storage directory under its size cap: least recently used blocks go.

The directory is a cache (any block can be computed again) that every worker mounting it
writes to, so every worker runs a janitor and the first to need a sweep does it; the
others skip while it holds ``<shared_dir>/.pdserve-janitor.lock`` (``flock``). A worker
sweeps after it has written a twentieth of the cap since its last sweep, after a write
failed for want of space (``ENOSPC``/``EDQUOT``), cap or not, and every ``STALE_S``
seconds that passed without a sweep, cap or not (leftovers of dead writers go even where
no cap ever calls a sweep: without one they stayed until the disk filled).

"Recently used" is a file's mtime: writers set it and, under a cap, readers bump it after
each good read (atime is not kept on ``noatime``/``relatime`` mounts). A sweep removes the oldest
files until the directory is at 90% of the cap (at 90% of what it holds after a failed
write), re-reading each file's mtime just before removing it so that a block used since
the scan stays; after a failed write, blocks younger than ``FRESH_S`` (maybe hand-offs
not yet read) go only where no older ones are. It also removes temporary files and
failure markers older than
``STALE_S``: those of writers that died. A reader that has the file open keeps reading it
after removal (POSIX); one that comes later misses it, which its fetch treats as any miss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".pdserve-janitor.lock"
STALE_S = 600.0  # a temp file or failure marker this old has no live writer
# A block file this young may be a hand-off its reader has not read yet (a pull waits
# ``kv_transfer.timeout_s`` for it, 10 s by default): a sweep after a space error removes
# one only where every block is this young.
FRESH_S = 60.0
LOW_WATER = 0.9  # a sweep brings the directory down to this fraction of its target
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


@dataclass(frozen=True, slots=True)
class _BlockFile:
    path: Path
    mtime_ns: int
    size: int


@dataclass(slots=True)
class SweepResult:
    scanned_bytes: int = 0
    removed_files: int = 0
    removed_bytes: int = 0
    removed_leftovers: int = 0
    skipped: bool = False  # another worker was sweeping


def is_space_error(exc: OSError) -> bool:
    return exc.errno in _SPACE_ERRNOS


def touch(path: Path) -> bool:
    """Mark ``path`` used now. False if it is gone."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except OSError:  # a read-only mount, say: the block is still there
        pass
    return True


def _scan(root: Path, now: float) -> tuple[list[_BlockFile], list[Path]]:
    """Every block file under ``root``, and the stale leftovers to remove."""
    blocks: list[_BlockFile] = []
    stale: list[Path] = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if name.endswith(".kvblock"):
                blocks.append(_BlockFile(path, st.st_mtime_ns, st.st_size))
            elif (name.endswith((".tmp", ".failed"))) and now - st.st_mtime > STALE_S:
                stale.append(path)
    return blocks, stale


def sweep(root: Path, max_bytes: int | None) -> SweepResult:
    """Remove least recently used block files under ``root`` until it holds at most
    ``LOW_WATER * max_bytes``; ``max_bytes=None``: free a tenth of what it holds (a
    write failed for space); ``max_bytes=0``: no cap, no block goes. Leftovers of dead
    writers go in every case. Returns at once, skipped, if another worker is sweeping."""
    result = SweepResult()
    with open(root / LOCK_NAME, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            result.skipped = True
            return result
        now_ns = _filesystem_now_ns(lock.fileno())
        blocks, stale = _scan(root, now_ns / 1e9)
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                result.removed_leftovers += 1
        total = sum(block.size for block in blocks)
        result.scanned_bytes = total
        limit = max_bytes if max_bytes is not None else total
        target = int(LOW_WATER * limit)
        if max_bytes is not None and (max_bytes == 0 or total <= max_bytes):
            return result
        blocks.sort(key=lambda block: block.mtime_ns)
        if max_bytes is None:
            # After a failed write, blocks younger than FRESH_S go only if no older one
            # does: a disk full of other data left a tenth that was the hand-off just
            # written (its reader waited out its deadline), and a disk that fills within
            # FRESH_S must still free some. (Under a cap, only a cap far too small for
            # the traffic reaches the young ones.)
            young_ns = now_ns - int(FRESH_S * 1e9)
            blocks = [block for block in blocks if block.mtime_ns <= young_ns] or blocks
        for block in blocks:
            if total <= target:
                break
            try:
                if block.path.stat().st_mtime_ns != block.mtime_ns:
                    continue  # used (or rewritten) since the scan
                block.path.unlink()
            except FileNotFoundError:
                pass
            else:
                result.removed_files += 1
                result.removed_bytes += block.size
            total -= block.size
    return result


def _filesystem_now_ns(fd: int) -> int:
    """Now by the clock that stamps the directory's mtimes (an NFS server's, not this
    host's): the lock file touched and read back. Compared with this host's clock, one
    11 minutes fast removed a write's temp file and a fresh failure marker as stale."""
    try:
        os.utime(fd)
        return os.fstat(fd).st_mtime_ns
    except OSError:  # (a read-only mount: nothing is written there anyway)
        return time.time_ns()


class StorageJanitor:
    """A background thread that sweeps ``root`` when told enough was written or a write
    failed for space, and every ``idle_sweep_s`` without a sweep. ``max_bytes=0``: no
    cap (blocks go only after space errors; leftovers on every sweep)."""

    def __init__(
        self, root: Path, max_bytes: int, name: str, idle_sweep_s: float = STALE_S
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.idle_sweep_s = idle_sweep_s
        self._lock = threading.Lock()
        self._written = 0
        self._space_error = False
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if max_bytes:
            self._wake.set()  # a first sweep: the cap may be lower than what is stored

    def note_written(self, num_bytes: int) -> None:
        if not self.max_bytes:
            return
        with self._lock:
            self._written += num_bytes
            due = self._written * 20 >= self.max_bytes
        if due:
            self._wake.set()

    def note_space_error(self) -> None:
        with self._lock:
            self._space_error = True
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.idle_sweep_s)  # woken, or idle that long: sweep
            self._wake.clear()
            if self._closed:
                return
            with self._lock:
                space_error, self._space_error = self._space_error, False
                self._written = 0
            try:
                result = sweep(self.root, None if space_error else self.max_bytes)
            except OSError as exc:
                logger.warning("sweeping %s failed: %s", self.root, exc)
                continue
            if result.removed_leftovers:
                logger.info("removed %d temporary files and failure markers of dead "
                            "writers from %s", result.removed_leftovers, self.root)  # fmt: skip
            if result.removed_files:
                logger.info(
                    "removed %d least recently used KV block files (%.1f MB) from %s",
                    result.removed_files, result.removed_bytes / 1e6, self.root,
                )  # fmt: skip
