"""``pdserve make-model``: write a random-weight checkpoint of a real architecture."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.models.maker import ARCHS, SIZES

    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, type=Path, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from engine.models.maker import make_model

    if (args.out / "config.json").exists():
        print(f"error: {args.out} already holds a checkpoint", file=sys.stderr)
        return 2
    path = make_model(args.arch, args.size, args.out, seed=args.seed)
    print(f"wrote a random-weight {args.arch}-{args.size} checkpoint to {path}")
    return 0


COMMAND = ("make a random-weight checkpoint of a real architecture (--arch)", add_arguments, run)
