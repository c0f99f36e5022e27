"""Wire pieces of the NIXL connector: the handshake section, notifications, descriptors.

Descriptor lists cover every (layer, block) of a cache, layer-major:

    index = layer * num_blocks + block_id
    desc[index] = (base_addr[layer] + block_id * block_bytes_per_layer,
                   block_bytes_per_layer, device_id)
"""

from __future__ import annotations

import msgspec
import numpy as np


class NixlPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The NIXL section of the handshake envelope."""

    agent_metadata: bytes
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    base_addrs: list[int]  # per layer


class Notif(msgspec.Struct, frozen=True, array_like=True):
    kind: str  # "done" | "abort"
    transfer_id: str


def block_descs(
    base_addrs: list[int], num_blocks: int, block_bytes: int, device_id: int
) -> np.ndarray:
    """[num_layers * num_blocks, 3] uint64 (addr, len, device): one row per (layer, block)."""
    bases = np.asarray(base_addrs, dtype=np.uint64)[:, None]
    offsets = np.arange(num_blocks, dtype=np.uint64)[None, :] * np.uint64(block_bytes)
    descs = np.empty((len(base_addrs) * num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = (bases + offsets).reshape(-1)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


def desc_indices(block_ids: tuple[int, ...], num_layers: int, num_blocks: int) -> np.ndarray:
    """Descriptor indices of ``block_ids`` in every layer, layer-major: [L * n] int32."""
    layers = np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks
    return (layers + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)
