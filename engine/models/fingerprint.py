"""A checkpoint's fingerprint: which weights compute a KV cache, as a short hex string.

Stored KV outlives the process that computed it (the shared-storage connector keeps block
files keyed by token prefix), so its key must change whenever the weights do: a model
updated in place, or a fine-tune that kept its base model's directory name and
``config.json``, would otherwise load the old weights' KV and decode wrong tokens.

The fingerprint hashes ``config.json`` and, per safetensors file: its name, its size, its
header (tensor names, dtypes, shapes, offsets) and ``NUM_SAMPLES`` slices of
``SAMPLE_BYTES`` spread evenly over the file. It reads a few MiB whatever the checkpoint's
size, and is equal on every host with a copy of the same files (no paths, no mtimes),
which prefill and decode workers need to find each other's files. Training moves every
weight, so any fine-tune changes the sampled bytes; an edit of a few bytes between the
samples would go unseen.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from engine.models.loader import safetensors_files

NUM_SAMPLES = 16
SAMPLE_BYTES = 64 << 10
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def weights_fingerprint(model_dir: Path) -> str:
    """12 hex digits naming ``model_dir``'s config and weights (see the module docstring)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_bytes, _MAX_HEADER_BYTES)))
            for i in range(NUM_SAMPLES):
                f.seek(size * i // NUM_SAMPLES)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:12]
