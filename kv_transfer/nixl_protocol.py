"""Wire pieces of the NIXL connector: the handshake section, notifications, descriptors.

A process describes its cache to NIXL in one of two granularities:

- per (layer, block), layer-major, for any arrangement of the memory (``layout.py``):

      index = layer * num_blocks + block_id
      desc[index] = (base_addr[layer] + block_id * block_stride, block_bytes_per_layer, dev)

- per whole block, where the caches are block-major (a block's layers side by side):

      desc[block_id] = (base_addr[0] + block_id * block_bytes, block_bytes, dev)

A fetch uses whole blocks when both sides are block-major (num_layers times fewer
descriptors, each num_layers times longer), else (layer, block) pairs.
"""

from __future__ import annotations

import msgspec
import numpy as np


class NixlPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The NIXL section of the handshake envelope."""

    agent_metadata: bytes
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    # Per layer, where its block 0 starts, when the layers are each contiguous (a block
    # stride of one layer's block). Empty when they are not: peers that predate
    # ``block_stride`` read only this field and would address strided layers wrongly, so
    # an empty list makes them refuse the handshake ("wrong number of layers").
    base_addrs: list[int]
    # Per layer, where its block 0 starts, in any arrangement, and the bytes from one block
    # of a layer to the next (``layout.py``). Absent from older peers (stride 0).
    layer_addrs: list[int] = []
    block_stride: int = 0

    def layer_addressing(self, block_bytes_per_layer: int) -> tuple[list[int], int]:
        """(per-layer base addresses, block stride), from whichever fields the peer sent."""
        if self.block_stride:
            return self.layer_addrs, self.block_stride
        return self.base_addrs, block_bytes_per_layer

    @classmethod
    def for_caches(
        cls,
        agent_metadata: bytes,
        mem_type: str,
        device_id: int,
        layer_addrs: list[int],
        block_stride: int,
        block_bytes_per_layer: int,
    ) -> NixlPayload:
        contiguous_layers = block_stride == block_bytes_per_layer
        return cls(
            agent_metadata=agent_metadata,
            mem_type=mem_type,
            device_id=device_id,
            base_addrs=layer_addrs if contiguous_layers else [],
            layer_addrs=layer_addrs,
            block_stride=block_stride,
        )


class Notif(msgspec.Struct, frozen=True, array_like=True):
    kind: str  # "done" | "abort"
    transfer_id: str


def is_block_major(base_addrs: list[int], block_stride: int, block_bytes_per_layer: int) -> bool:
    """Does every block's memory form one run, layer 0 to the last (whole-block descriptors)?"""
    block_bytes = len(base_addrs) * block_bytes_per_layer
    return block_stride == block_bytes and all(
        addr == base_addrs[0] + layer * block_bytes_per_layer
        for layer, addr in enumerate(base_addrs)
    )


def layer_block_descs(
    base_addrs: list[int],
    num_blocks: int,
    block_bytes_per_layer: int,
    block_stride: int,
    device_id: int,
) -> np.ndarray:
    """[num_layers * num_blocks, 3] uint64 (addr, len, device): one row per (layer, block)."""
    bases = np.asarray(base_addrs, dtype=np.uint64)[:, None]
    offsets = np.arange(num_blocks, dtype=np.uint64)[None, :] * np.uint64(block_stride)
    descs = np.empty((len(base_addrs) * num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = (bases + offsets).reshape(-1)
    descs[:, 1] = block_bytes_per_layer
    descs[:, 2] = device_id
    return descs


def whole_block_descs(
    base_addr: int, num_blocks: int, block_bytes: int, device_id: int
) -> np.ndarray:
    """[num_blocks, 3] uint64 (addr, len, device): one row per block, all its layers."""
    return layer_block_descs([base_addr], num_blocks, block_bytes, block_bytes, device_id)


def desc_indices(
    block_ids: tuple[int, ...], num_layers: int, num_blocks: int, whole_blocks: bool
) -> np.ndarray:
    """Descriptor indices of ``block_ids``: the ids themselves with whole-block
    descriptors ([n] int32), else the ids in every layer, layer-major ([L * n] int32)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if whole_blocks:
        return ids.astype(np.int32)
    layers = np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks
    return (layers + ids[None, :]).reshape(-1).astype(np.int32)
