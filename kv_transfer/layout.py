"""What a KV cache looks like, as exchanged at handshake, and the registered caches.

The engine fixes the layout (DESIGN.md): one tensor per layer,

    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

so one block of one layer is a contiguous run of ``block_bytes_per_layer`` bytes at
``base(layer) + block_id * block_bytes_per_layer``, and a block id names the same slot in
every layer. Two engines can exchange blocks only if every field of ``KVLayout`` agrees;
``num_blocks`` is each engine's own capacity and may differ.
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

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @classmethod
    def from_tensors(cls, kv_caches: Sequence[torch.Tensor]) -> KVCaches:
        """Check that the tensors form one valid cache; raise ``ValueError`` if not.

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
            if not tensor.is_contiguous():
                raise ValueError(f"layer {layer}: KV cache must be contiguous")
        num_blocks, _, block_size, num_kv_heads, head_dim = first.shape
        layout = KVLayout(
            num_layers=len(kv_caches),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=str(first.dtype).removeprefix("torch."),
        )
        return cls(tensors=tuple(kv_caches), layout=layout, num_blocks=num_blocks)

    def check_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        """Raise ``ValueError`` unless every id is a distinct valid block of this cache."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"{what}: block id {block_id} outside [0, {self.num_blocks})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{what}: block ids repeat")
