"""What a KV cache looks like, as exchanged at handshake, and the registered caches.

The engine fixes the layout (DESIGN.md): one tensor per layer,

    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

so one block of one layer is a contiguous run of ``block_bytes_per_layer`` bytes at
``base(layer) + block_id * block_stride``, and a block id names the same slot in every
layer. Two arrangements of that memory are accepted:

- *separate*: each layer its own contiguous tensor (``block_stride`` = one layer's block);
- *block-major*: the layers are views ``buffer[:, layer]`` of one contiguous
  ``[num_blocks, num_layers, 2, block_size, H, D]`` buffer, so a block's layers sit side by
  side and the whole block is one run of ``block_bytes`` (``block_stride`` = that). The
  engine allocates this way (``engine.host_memory.zeros_for_kv_caches``): a transport that
  addresses memory directly (NIXL) then moves one region per block instead of one per
  (layer, block).

The arrangement is each process's own business (NIXL tells peers its strides); two engines
can exchange blocks if every field of ``KVLayout`` agrees; ``num_blocks`` is each engine's
own capacity and may differ.

Under tensor parallelism each rank's cache holds its own KV heads, and rank r of one engine
exchanges blocks with rank r of another of the same size: ``tp_size`` and ``tp_rank`` are
part of the layout, so pairing other sizes (or ranks) is a mismatch that moves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from kv_transfer.errors import LayoutMismatchError

KV_TENSOR_LAYOUT = "block,kv,token,head,dim"
"""Axis order of each layer's tensor; a future layout (say heads first) gets another name."""


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of one block, everything a peer must agree on before bytes move."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    tensor_layout: str = KV_TENSOR_LAYOUT
    tp_size: int = 1  # tensor-parallel ranks of the engine; each holds its KV heads
    tp_rank: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown KV dtype {self.dtype!r}")
        return dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block of one layer: [2, block_size, num_kv_heads, head_dim]."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes_per_layer(self) -> int:
        numel = 2 * self.block_size * self.num_kv_heads * self.head_dim
        return numel * self.torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.num_layers * self.block_bytes_per_layer

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ``LayoutMismatchError`` naming every field where ``other`` differs."""
        mismatches = {
            field: (getattr(self, field), getattr(other, field))
            for field in self.__struct_fields__
            if getattr(self, field) != getattr(other, field)
        }
        if mismatches:
            raise LayoutMismatchError(mismatches)


@dataclass(frozen=True, slots=True)
class KVCaches:
    """The engine's KV tensors as registered with a connector, validated once."""

    tensors: tuple[torch.Tensor, ...]  # per layer [num_blocks, 2, block_size, H, D]
    layout: KVLayout
    num_blocks: int
    block_stride_bytes: int  # from one block of a layer to the next
    block_major: bool  # views of one [num_blocks, num_layers, ...] buffer

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the memory the caches occupy: one region when block-major,
        else one per layer."""
        if self.block_major:
            return [(self.tensors[0].data_ptr(), self.num_blocks * self.layout.block_bytes)]
        size = self.num_blocks * self.layout.block_bytes_per_layer
        return [(tensor.data_ptr(), size) for tensor in self.tensors]

    @classmethod
    def from_tensors(
        cls, kv_caches: Sequence[torch.Tensor], tp_size: int = 1, tp_rank: int = 0
    ) -> KVCaches:
        """Check that the tensors form one valid cache (rank ``tp_rank`` of ``tp_size``'s),
        in one of the two arrangements in the module docstring; raise ``ValueError`` if not.

        The tensors are kept by reference: connectors read and write them in place, so
        the engine must not reallocate them while the connector lives.
        """
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[1] != 2:
            raise ValueError(
                "each KV cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
                f"got {tuple(first.shape)}"
            )
        for layer, tensor in enumerate(kv_caches):
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise ValueError(f"layer {layer}: shape/dtype differs from layer 0")
            if tensor.device != first.device:
                raise ValueError(f"layer {layer}: on {tensor.device}, layer 0 on {first.device}")
        num_blocks, _, block_size, num_kv_heads, head_dim = first.shape
        layout = KVLayout(
            num_layers=len(kv_caches),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=str(first.dtype).removeprefix("torch."),
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        block_major = len(kv_caches) > 1 and _is_block_major(kv_caches, layout)
        if not block_major:
            for layer, tensor in enumerate(kv_caches):
                if not tensor.is_contiguous():
                    raise ValueError(
                        f"layer {layer}: KV caches must each be contiguous, or the per-layer "
                        "views of one contiguous [num_blocks, num_layers, 2, block_size, "
                        "num_kv_heads, head_dim] buffer"
                    )
        stride = layout.block_bytes if block_major else layout.block_bytes_per_layer
        return cls(tuple(kv_caches), layout, num_blocks, stride, block_major)

    def check_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        """Raise ``ValueError`` unless every id is a distinct valid block of this cache."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"{what}: block id {block_id} outside [0, {self.num_blocks})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{what}: block ids repeat")


def _is_block_major(kv_caches: Sequence[torch.Tensor], layout: KVLayout) -> bool:
    """Are the tensors ``buffer[:, layer]`` of one contiguous block-major buffer?"""
    first = kv_caches[0]
    if first.shape[0] == 0 or not first[0].is_contiguous():
        return False
    base = first.data_ptr()
    storage = first.untyped_storage()
    if base + first.shape[0] * layout.block_bytes > storage.data_ptr() + storage.nbytes():
        return False  # the buffer would run past the memory it lives in
    return all(
        tensor.stride() == first.stride()
        and tensor.stride(0) * layout.torch_dtype.itemsize == layout.block_bytes
        and tensor.data_ptr() == base + layer * layout.block_bytes_per_layer
        and tensor.untyped_storage().data_ptr() == storage.data_ptr()
        for layer, tensor in enumerate(kv_caches)
    )
