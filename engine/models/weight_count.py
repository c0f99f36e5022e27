"""How many weights a checkpoint holds once the engine has loaded it, from the headers of
its safetensors files alone (no tensor is read): what a deployment sizes memory by."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from engine.models.arch import safetensors_files
from engine.models.fp8_weights import SIDECAR_SUFFIXES

# GPT-OSS's MXFP4 experts: two 4-bit values per stored byte, and their exponents.
_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"


def stored_tensors(model_dir: Path) -> Iterator[tuple[str, str, int]]:
    """(name, safetensors dtype such as "BF16" or "F8_E4M3", elements) of every tensor the
    checkpoint stores, read from its files' headers."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = f.get_slice(name)
                yield name, part.get_dtype(), math.prod(part.get_shape())


def loaded_weight_count(model_dir: Path) -> int:
    """Every stored tensor's elements, MXFP4 blocks at two weights per byte, and no scales
    (FP8's or MXFP4's): the engine dequantizes both to the model dtype, so the weights it
    holds take this many elements of that dtype, whatever the files' dtypes."""
    return sum(
        elements * (2 if name.endswith(_MXFP4_BLOCKS) else 1)
        for name, _, elements in stored_tensors(model_dir)
        if not name.endswith((*SIDECAR_SUFFIXES, _MXFP4_SCALES))
    )
