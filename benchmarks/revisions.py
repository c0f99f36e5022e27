"""Benchmarks that put this code beside an earlier revision of this repository (``--before
REV``): the script (from this tree) runs again in a subprocess on a temporary ``git
worktree`` of REV, whose packages come first on the path, and prints its rows as JSON on
stdout (its ``--rows-only`` mode). Also the arguments, record header and record files
those benchmarks share (``host_step``, ``shared_prefix_prefill``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


def add_record_args(parser: argparse.ArgumentParser) -> None:
    """``--tag``/``--out-dir``: where the record goes."""
    parser.add_argument("--tag", default="cpu", help="suffix of the record's files")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)


def add_args(parser: argparse.ArgumentParser) -> None:
    """``--before REV``, the record's arguments, and the child's hidden ``--rows-only``."""
    parser.add_argument("--before", default=None, help="a revision to run side by side")
    add_record_args(parser)
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)


def side_by_side(
    args: argparse.Namespace, argv: list[str], script: Path,
    run_cases: Callable[[argparse.Namespace], list[dict]],
) -> tuple[list[dict], list[dict] | None] | None:  # fmt: skip
    """The rows of this code and, with ``--before``, of that revision (same cases). None
    in the ``--rows-only`` child, which prints its rows instead."""
    if args.rows_only:
        print(json.dumps(run_cases(args)))
        return None
    print("now:", file=sys.stderr)
    rows = run_cases(args)
    if not args.before:
        return rows, None
    print(f"{args.before}:", file=sys.stderr)
    return rows, rows_at(args.before, script, without_before(argv))


def write_record(args: argparse.Namespace, name: str, argv: list[str], fields: dict[str, Any],
                 markdown: Callable[[dict], str]) -> None:  # fmt: skip
    """``<out-dir>/<name>_<tag>.json`` and ``.md``: the machine, torch, date and command
    line, then ``fields``."""
    import torch

    from benchmarks.engine_throughput import machine

    record = {
        "machine": machine(), "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "argv": " ".join(argv),
        "before": getattr(args, "before", None), **fields,
    }  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{name}_{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(record))
    print(f"wrote {stem}.json and .md")


def rows_at(revision: str, script: Path, argv: list[str]) -> Any:
    """``script argv --rows-only`` run on a worktree of ``revision``; its parsed stdout."""
    with tempfile.TemporaryDirectory(prefix="pdserve-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision],
                       cwd=ROOT, check=True)  # fmt: skip
        # The script imports this module, which an older tree may lack: it comes from this
        # tree, like the script; everything else is REV's.
        shutil.copy(Path(__file__), tree / "benchmarks" / "revisions.py")
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


def command_line(record: dict[str, Any], module: str) -> str:
    """How a record says what ran where: ``python -m benchmarks.<module> ARGS`` on the
    machine, with torch and the date."""
    return (f"`python -m benchmarks.{module} {record['argv']}` on {record['machine']} "
            f"(torch {record['torch']}, {record['date']})")  # fmt: skip
