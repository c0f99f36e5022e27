"""Pack blocks of several layers into one contiguous staging tensor, and back.

Transports that move bytes through a buffer (NCCL, shared storage) stage a *layer group*:

    staging: [num_group_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]

``staging[i, j]`` is block ``block_ids[j]`` of layer ``layers[i]``. The copies go through
``kernels.reference.gather_blocks`` / ``scatter_blocks`` (the engine's kernels), so a faster
kernel lands here without changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.reference import gather_blocks, scatter_blocks
from kv_transfer.layout import KVCaches, KVLayout


def bind_device(device: torch.device) -> None:
    """Make ``device`` current in this (background) thread, so that CUDA work and
    transports that use the current context (UCX cuda_ipc, NCCL) find it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def block_id_tensor(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64, device=device)  # [n]


def staging_numel(layout: KVLayout, num_layers: int, num_blocks: int) -> int:
    """Elements of a staging tensor for ``num_blocks`` blocks of ``num_layers`` layers."""
    return num_layers * num_blocks * layout.block_bytes_per_layer // layout.torch_dtype.itemsize


def staging_view(
    flat: torch.Tensor, layout: KVLayout, num_layers: int, num_blocks: int
) -> torch.Tensor:
    """A [num_layers, num_blocks, 2, block_size, H, D] view at the front of ``flat``."""
    shape = (num_layers, num_blocks, *layout.block_shape)
    return flat[: staging_numel(layout, num_layers, num_blocks)].view(shape)


def gather_layers(
    kv: KVCaches,
    layers: range,
    block_ids: torch.Tensor,  # [n] int64 on kv.device
    out: torch.Tensor,  # [len(layers), n, 2, block_size, H, D]
) -> None:
    for i, layer in enumerate(layers):
        gather_blocks(kv.tensors[layer], block_ids, out=out[i])


def scatter_layers(
    staging: torch.Tensor,  # [len(layers), n, 2, block_size, H, D]
    kv: KVCaches,
    layers: range,
    block_ids: torch.Tensor,  # [n] int64 on kv.device
) -> None:
    for i, layer in enumerate(layers):
        scatter_blocks(staging[i], kv.tensors[layer], block_ids)


def layer_groups(layout: KVLayout, num_blocks: int, staging_bytes: int) -> list[range]:
    """Split the layers into consecutive groups whose blocks fit ``staging_bytes``
    (at least one layer per group, however large)."""
    per_layer = max(1, num_blocks * layout.block_bytes_per_layer)
    return groups_of(layout.num_layers, staging_bytes // per_layer)


def groups_of(num_layers: int, layers_per_group: int) -> list[range]:
    """Consecutive ranges of ``layers_per_group`` layers (clamped to [1, num_layers])."""
    size = max(1, min(num_layers, layers_per_group))
    return [range(start, min(start + size, num_layers)) for start in range(0, num_layers, size)]


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 too)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")
