"""A checkpoint's safetensors files, and their headers read without torch."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

from engine.models.errors import ModelLoadError

_MAX_SAFETENSORS_HEADER_BYTES = 100 << 20


def read_safetensors_header(f: BinaryIO) -> bytes:
    """The JSON header of the safetensors file ``f`` (binary, read from its start), as
    stored: the format is an 8-byte little-endian length, then that many bytes of JSON
    (at most 100 MiB, the format's own limit), then the tensors' data. Read by hand, not
    through ``safe_open``, so that reading headers needs no torch."""
    (num_bytes,) = struct.unpack("<Q", f.read(8))
    return f.read(min(num_bytes, _MAX_SAFETENSORS_HEADER_BYTES))


def safetensors_files(model_dir: Path) -> list[Path]:
    """A checkpoint's safetensors files: the shards its index lists, or the files present."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are loaded)"
    )
