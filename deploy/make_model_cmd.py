"""``pdserve make-model``: write a random-weight checkpoint of a real architecture."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.models.fp8_config import SCHEMES
    from engine.models.maker import ARCHS, SIZES

    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, type=Path, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    layouts = ("store the projections in FP8, in one released layout: fp8-block (transformers' "
               "block-scaled), fp8-tensor (AutoFP8), ct-tensor / ct-channel / ct-block "
               "(compressed-tensors), fbgemm (per row), modelopt (NVIDIA's)")  # fmt: skip
    parser.add_argument("--fp8", choices=SCHEMES, help=layouts)


def run(args: argparse.Namespace) -> int:
    from engine.models.fp8_maker import quantize_checkpoint
    from engine.models.maker import make_model

    if (args.out / "config.json").exists():
        print(f"error: {args.out} already holds a checkpoint", file=sys.stderr)
        return 2
    if args.fp8 is None:
        path = make_model(args.arch, args.size, args.out, seed=args.seed)
        print(f"wrote a random-weight {args.arch}-{args.size} checkpoint to {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_model(args.arch, args.size, Path(tmp) / "model", seed=args.seed)
        path = quantize_checkpoint(plain, args.out, args.fp8)
    print(f"wrote a random-weight {args.arch}-{args.size} checkpoint, FP8 weights in the "
          f"{args.fp8} layout, to {path}")  # fmt: skip
    return 0


COMMAND = ("make a random-weight checkpoint of a real architecture (--arch)", add_arguments, run)
