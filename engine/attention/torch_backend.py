"""Attention in plain torch: works on every device. Decodes run as one padded batch, prompt
segments one at a time through ``scaled_dot_product_attention``.

Per-step work (the decode masks) is done once in ``build_metadata``, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend, BatchLayout, LayerSpec
from kernels import reference


@dataclass(slots=True)
class TorchMetadata:
    layout: BatchLayout
    num_decode_key_slots: int
    # sliding window (None: full) → additive float mask [num_decodes, 1, 1, key slots]
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        mask = self.decode_masks.get(sliding_window)
        if mask is None:
            seq_lens = self.layout.seq_lens[: self.layout.num_decodes]
            allowed = reference.decode_mask(seq_lens, self.num_decode_key_slots, sliding_window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, float("-inf"))
            self.decode_masks[sliding_window] = mask
        return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build_metadata(self, layout: BatchLayout) -> TorchMetadata:
        num_decodes = layout.num_decodes
        max_decode_len = max(layout.seq_lens_cpu[:num_decodes], default=0)
        num_slots = -(-max_decode_len // self.block_size) * self.block_size
        return TorchMetadata(layout, num_slots)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
        layer: LayerSpec,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchMetadata)
        layout = metadata.layout
        reference.store_kv(key, value, kv_cache, layout.slot_mapping)
        num_decodes = layout.num_decodes
        out = torch.empty_like(query)
        if num_decodes:
            out[:num_decodes] = reference.decode_attention(
                query[:num_decodes],
                kv_cache,
                layout.seq_lens[:num_decodes],
                layout.block_table[:num_decodes],
                layer.scale,
                layer.sliding_window,
                attn_mask=metadata.decode_mask(layer.sliding_window, query.dtype),
            )
        if num_decodes < layout.num_seqs:
            start = layout.query_start_loc_cpu[num_decodes]
            out[start:] = reference.paged_attention(
                query[start:],
                kv_cache,
                layout.query_start_loc[num_decodes:] - start,
                layout.seq_lens[num_decodes:],
                layout.block_table[num_decodes:],
                layer.scale,
                layer.sliding_window,
            )
        return out
