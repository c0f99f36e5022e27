"""How many weights a checkpoint holds once the engine has loaded it, from the headers of
its safetensors files alone (no tensor is read): what a deployment sizes memory by."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

from common.hf_config import text_config
from engine.models.bnb_config import SIDECAR_SUFFIXES as BNB_SIDECARS
from engine.models.bnb_config import read_bnb_config
from engine.models.checkpoint_files import read_safetensors_header, safetensors_files
from engine.models.fp8_config import SIDECAR_SUFFIXES, read_quantization_config
from engine.models.int_weights_config import read_int_weights_config

# GPT-OSS's MXFP4 experts: two 4-bit values per stored byte, and their exponents.
_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"


def stored_tensors(model_dir: Path) -> Iterator[tuple[str, str, int]]:
    """(name, safetensors dtype such as "BF16" or "F8_E4M3", elements) of every tensor the
    checkpoint stores, read from its files' headers (no torch: ``pdserve deploy`` sizes
    pods with this)."""
    for path in safetensors_files(model_dir):
        with open(path, "rb") as f:
            header = json.loads(read_safetensors_header(f))
        for name, entry in header.items():
            if name != "__metadata__":
                yield name, entry["dtype"], math.prod(entry["shape"])


def loaded_weight_count(model_dir: Path) -> int:
    """Every stored tensor's elements, MXFP4 blocks and bitsandbytes' 4-bit bytes at two
    weights each, packed integer words at 32 / bits each, and no scales, zeros, group
    indices or quantization states: the engine dequantizes them all to the model dtype,
    so the weights it holds take this many elements of that dtype, whatever the files'
    dtypes."""
    config = json.loads((model_dir / "config.json").read_text())
    quantization = read_quantization_config(config, text_config(config), model_dir)
    ints = read_int_weights_config(quantization, model_dir) if quantization else None
    bnb = read_bnb_config(quantization, model_dir) if quantization else None
    skipped = (*SIDECAR_SUFFIXES, _MXFP4_SCALES, *(ints.names.sidecars if ints else ()),
               *(BNB_SIDECARS if bnb else ()))  # fmt: skip

    def weights_per_element(name: str, dtype: str) -> int:
        if name.endswith(_MXFP4_BLOCKS) or (bnb is not None and dtype == "U8"):
            return 2  # two 4-bit values a byte
        if ints is None or not name.endswith(ints.names.packed):
            return 1
        layout = ints.for_module(name.removesuffix(ints.names.packed))
        return (layout or ints).per_word

    return sum(
        elements * weights_per_element(name, dtype)
        for name, dtype, elements in stored_tensors(model_dir)
        if not name.endswith(skipped)
    )
