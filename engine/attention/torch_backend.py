"""Attention in plain torch: works on every device. Decodes run as one padded batch, prompt
segments one at a time through ``scaled_dot_product_attention``."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, BatchLayout, LayerSpec
from kernels import reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
        layer: LayerSpec,
    ) -> torch.Tensor:
        layout = metadata
        assert isinstance(layout, BatchLayout)
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
