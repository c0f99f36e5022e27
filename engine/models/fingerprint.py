"""A checkpoint's fingerprint: which weights compute a KV cache, as a short hex string.

Stored KV outlives the process that computed it (the shared-storage connector keeps block
files keyed by token prefix), so its key must change whenever the weights do: a model
updated in place, or a fine-tune that kept its base model's directory name and
``config.json``, would otherwise load the old weights' KV and decode wrong tokens.

The fingerprint hashes ``config.json``, the image preprocessing files where the model has
them (``PREPROCESSING_FILES``: an image's KV is keyed by its encoded bytes, and resizing or
normalising them differently computes other KV at the same key), and, per safetensors
file, its name, size and header (tensor names, dtypes, shapes, offsets), then from *every
tensor* up to ``SAMPLES_PER_TENSOR`` slices of ``SAMPLE_BYTES`` (its start, middle and
end). It reads
a few KiB per tensor (about 2 MiB for a 300-tensor model) whatever the checkpoint's size,
and is equal on every host with a copy of the same files (no paths, no mtimes), which
prefill and decode workers need to find each other's files. A change that rewrites
whole tensors is seen, however few: a fine-tune, a merged LoRA adapter, a re-quantised
layer. An edit of a few bytes inside one tensor, between the samples, is not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common.model_info import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from engine.models.checkpoint_files import read_safetensors_header, safetensors_files

SAMPLES_PER_TENSOR = 3
SAMPLE_BYTES = 4 << 10
PREPROCESSING_FILES = ("preprocessor_config.json", "processor_config.json")


def _sample_offsets(begin: int, end: int) -> list[int]:
    """Where the slices of one tensor's bytes [begin, end) start."""
    last = max(begin, end - SAMPLE_BYTES)
    middle = begin + (end - begin - SAMPLE_BYTES) // 2
    return sorted({begin, max(begin, middle), last})[:SAMPLES_PER_TENSOR]


def _hash_safetensors(digest: hashlib._Hash, path: Path) -> None:
    """Add one safetensors file's name, size, header and tensor samples to ``digest``."""
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        header = read_safetensors_header(f)
        digest.update(header)
        data_start = 8 + len(header)
        tensors = json.loads(header)
        ranges = sorted(
            tuple(entry["data_offsets"])
            for name, entry in tensors.items()
            if name != "__metadata__"
        )
        for begin, end in ranges:
            for offset in _sample_offsets(begin, end):
                f.seek(data_start + offset)
                digest.update(f.read(min(SAMPLE_BYTES, end - offset)))


def weights_fingerprint(model_dir: Path) -> str:
    """12 hex digits naming ``model_dir``'s config and weights (see the module docstring)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for name in PREPROCESSING_FILES:
        path = model_dir / name
        if path.is_file():  # (a text model's fingerprint is what it was before these)
            digest.update(f"{name}\0".encode() + path.read_bytes())
    for path in safetensors_files(model_dir):
        _hash_safetensors(digest, path)
    return digest.hexdigest()[:12]


def adapter_fingerprint(adapter_dir: Path) -> str:
    """The same for a LoRA adapter: its ``adapter_config.json`` and weights file."""
    digest = hashlib.sha256((adapter_dir / ADAPTER_CONFIG).read_bytes())
    _hash_safetensors(digest, adapter_dir / ADAPTER_WEIGHTS)
    return digest.hexdigest()[:12]
