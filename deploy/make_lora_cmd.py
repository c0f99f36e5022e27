"""``pdserve make-lora``: write a random LoRA adapter (PEFT format) for a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.model_info import LORA_MAKER_TARGETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=None, help="the base checkpoint (default: the demo model)"
    )
    parser.add_argument("--out", required=True, type=Path, help="directory to create")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=LORA_MAKER_TARGETS,
        default=list(LORA_MAKER_TARGETS),
        metavar="MODULE",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from engine.models.lora import ADAPTER_CONFIG
    from engine.models.lora_maker import make_lora_adapter
    from engine.models.maker import ensure_model

    if (args.out / ADAPTER_CONFIG).exists():
        print(f"error: {args.out} already holds an adapter", file=sys.stderr)
        return 2
    if args.rank < 1:
        print("error: --rank must be >= 1", file=sys.stderr)
        return 2
    from engine.models.errors import ModelLoadError

    model = args.model or ensure_model()
    try:
        path = make_lora_adapter(
            model, args.out, rank=args.rank, alpha=args.alpha, targets=args.targets,
            seed=args.seed,
        )  # fmt: skip
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a random rank-{args.rank} LoRA adapter for {model} to {path}")
    return 0


COMMAND = ("make a random LoRA adapter for a checkpoint (PEFT format)", add_arguments, run)
