"""The log files ``pdserve up`` gives its children: each bounded to about twice
``max_bytes`` (the live file and one older part, ``<name>.log.1``), so a worker that
crash-loops (a traceback every restart) or logs a warning per failed request for weeks
cannot fill the disk.

A child writes its log through a descriptor opened for appending, which it keeps for
its life, so a running child's log is cut as logrotate's ``copytruncate`` does: copied
to ``.1``, then truncated to nothing (the child's next write lands at the new end). A
line written between the copy and the truncation is lost: one check every few seconds,
on a file that reached ``max_bytes``, makes that rare. A log found too large when its
child is (re)started is renamed instead, losing nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO

LOG_MAX_BYTES = 64 << 20


def older_part(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def open_log(path: Path, max_bytes: int = LOG_MAX_BYTES) -> BinaryIO:
    """``path`` opened for appending, for a child about to start; moved to its older part
    first when it has reached ``max_bytes``."""
    if _size(path) >= max_bytes:
        path.replace(older_part(path))
    return open(path, "ab")


def cut_if_full(path: Path, max_bytes: int = LOG_MAX_BYTES) -> bool:
    """Copy ``path`` to its older part and truncate it when it has reached ``max_bytes``
    (its writer keeps appending to it); True when it did."""
    if _size(path) < max_bytes:
        return False
    shutil.copyfile(path, older_part(path))
    os.truncate(path, 0)
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
