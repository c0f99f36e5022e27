"""``pdserve make-model``: write a random-weight checkpoint of a real architecture."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.models.fp8_config import SCHEMES
    from engine.models.int_weights_config import SCHEMES as INT_SCHEMES
    from engine.models.maker import ARCHS, SIZES

    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", required=True, type=Path, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    layouts = ("store the projections in FP8, in one released layout: fp8-block (transformers' "
               "block-scaled), fp8-tensor (AutoFP8), ct-tensor / ct-channel / ct-block "
               "(compressed-tensors), fbgemm (per row), modelopt (NVIDIA's)")  # fmt: skip
    quantized = parser.add_mutually_exclusive_group()
    quantized.add_argument("--fp8", choices=SCHEMES, help=layouts)
    packed = ("store the projections as packed integers, round-to-nearest in groups of 32: "
              "gptq (4-bit, symmetric, v1), gptq-act-order, gptq-v2 (asymmetric), gptq-8bit, "
              "gptq-dynamic (GPTQModel's per-module rules), "
              "awq (4-bit gemm), ct-w4a16 / ct-w4a16-asym-act-order / ct-w8a16-channel "
              "(compressed-tensors pack-quantized)")  # fmt: skip
    quantized.add_argument("--int", choices=sorted(INT_SCHEMES), help=packed)


def run(args: argparse.Namespace) -> int:
    from engine.models.fp8_maker import quantize_checkpoint
    from engine.models.int_weights_maker import quantize_int_checkpoint
    from engine.models.maker import make_model

    if (args.out / "config.json").exists():
        print(f"error: {args.out} already holds a checkpoint", file=sys.stderr)
        return 2
    if args.fp8 is None and args.int is None:
        path = make_model(args.arch, args.size, args.out, seed=args.seed)
        print(f"wrote a random-weight {args.arch}-{args.size} checkpoint to {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_model(args.arch, args.size, Path(tmp) / "model", seed=args.seed)
        if args.fp8 is not None:
            path, layout = quantize_checkpoint(plain, args.out, args.fp8), f"FP8 ({args.fp8})"
        else:
            path = quantize_int_checkpoint(plain, args.out, args.int, seed=args.seed)
            layout = f"packed integer ({args.int})"
    print(f"wrote a random-weight {args.arch}-{args.size} checkpoint, {layout} weights, to "
          f"{path}")  # fmt: skip
    return 0


COMMAND = ("make a random-weight checkpoint of a real architecture (--arch)", add_arguments, run)
