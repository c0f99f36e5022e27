"""Run a benchmark script against an earlier revision of this repository, for the
``--before REV`` columns: the script (from this tree) runs in a subprocess on a temporary
``git worktree`` of REV, whose packages come first on the path, and prints its rows as
JSON on stdout (its ``--rows-only`` mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def rows_at(revision: str, script: Path, argv: list[str]) -> Any:
    """``script argv --rows-only`` run on a worktree of ``revision``; its parsed stdout."""
    with tempfile.TemporaryDirectory(prefix="pdserve-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision],
                       cwd=ROOT, check=True)  # fmt: skip
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            done = subprocess.run(
                [sys.executable, str(script.resolve()), *argv, "--rows-only"],
                cwd=tree, env=env, check=True, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False)  # fmt: skip
    return json.loads(done.stdout)


def without_before(argv: list[str]) -> list[str]:
    """``argv`` less its ``--before REV`` (or ``--before=REV``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--before":
            skip = True
        elif not arg.startswith("--before="):
            out.append(arg)
    return out
