"""Paths named after the process that owns them, so a later process can remove what a
killed one left behind (a SIGKILLed process runs no cleanup).

A name carries ``<host>-<pid>``: containers that share a volume each see their own pids,
and the host name keeps one container from judging another's pid. Only this host's paths
whose pid is gone are removed; a reused pid keeps a stale path until that process exits,
which errs on the side of leaving things alone.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
from pathlib import Path


def owner_tag() -> str:
    """``<host>-<pid>`` of this process, for a path's name."""
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_dead_owners(directory: Path, prefix: str, suffix: str = "") -> list[Path]:
    """Remove ``directory/<prefix><host>-<pid>[-<any>]<suffix>`` (files or directories) of
    this host whose process is gone (``-<any>``: ``mkdtemp``'s random tail). Returns what
    was removed."""
    host = socket.gethostname()
    head = f"{prefix}{host}-"
    removed = []
    for path in directory.glob(f"{glob.escape(head)}*{glob.escape(suffix)}"):
        rest = path.name[len(head) : len(path.name) - len(suffix)]
        pid = rest.partition("-")[0]
        if not (pid.isascii() and pid.isdigit()) or pid_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists here (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
