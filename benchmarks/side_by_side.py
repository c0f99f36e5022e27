"""What the engine-level side-by-side benchmarks share (``kv_cache_dtype``, ``priority``,
``tensor_parallel``): the model they run (a checkpoint, or a made llama of a size), where
the record goes, and the header every record starts with (machine, cores, torch, date,
model), so that records from different runs and machines read alike."""

from __future__ import annotations

import argparse
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_throughput import machine

RESULTS = Path(__file__).parent / "results"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``/``--size`` (what runs) and ``--tag``/``--out-dir`` (where it is kept)."""
    parser.add_argument("--model", default=None, help="checkpoint (default: a made llama)")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--tag", default="cpu" if not torch.cuda.is_available() else "cuda",
                        help="suffix of the record's files")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=RESULTS)


def model_dir(args: argparse.Namespace) -> Path:
    """The checkpoint ``--model`` names, or the made llama of ``--size`` (made once)."""
    from engine.models.maker import ensure_model

    return Path(args.model) if args.model else ensure_model("llama", args.size)


def record_header(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "machine": machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": args.model or f"llama {args.size}",
    }
