"""A child of ``pdserve up`` ends with its launcher: the kernel sends it SIGTERM (a drain)
when the launcher dies, even by SIGKILL, so no worker or router runs on under pid 1.

The child arranges this itself, first thing in ``pdserve``'s main, rather than the
launcher in a ``preexec_fn``: code run between fork and exec in a process with threads
can deadlock (a lock held by a thread that the fork did not copy), and a ``preexec_fn``
keeps ``subprocess`` from its faster spawn paths. The launcher names itself in
``PDSERVE_PARENT_PID``; the child checks that it is still its parent after setting the
signal, which closes the gap where the launcher died before the child got that far.
"""

from __future__ import annotations

import os
import signal
import sys

PARENT_PID_ENV = "PDSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


class ParentGone(RuntimeError):
    """The launcher that started this process is gone: the process should not start."""


def term_with_parent(environ: dict[str, str] | None = None) -> None:
    """Take SIGTERM when the launcher named in ``PDSERVE_PARENT_PID`` dies; raise
    ``ParentGone`` if it already has. The variable is removed from the environment (of
    ``environ``, default ``os.environ``), so processes this one starts (tensor-parallel
    shards, which watch their own parent) do not read it as theirs. Linux only; elsewhere
    a no-op but for that removal."""
    environ = os.environ if environ is None else environ
    value = environ.pop(PARENT_PID_ENV, None)
    if value is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(value):  # reparented: it died before the signal was set
        raise ParentGone(f"pdserve up (pid {value}) is gone; not starting")
