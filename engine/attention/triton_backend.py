"""Attention through the Triton kernels: one KV-store launch, then one decode launch (split-KV
when the batch is small and contexts long) and one prefill launch for the prompt chunks.

Runs on CUDA; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``kernels`` is imported), which the tests use. Sliding windows are supported.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, BatchLayout, LayerSpec
from kernels.kv_store import store_kv
from kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: object,
        layer: LayerSpec,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        layout = metadata
        assert isinstance(layout, BatchLayout)
        # registry.resolve_backend_name keeps latent attention (DeepSeek) on torch.
        assert layer.latent_dim is None, "no latent-attention kernel"
        store_kv(key, value, kv_cache, layout.slot_mapping)
        return paged_attention(
            query,
            kv_cache,
            layout.query_start_loc,
            layout.seq_lens,
            layout.block_table,
            layer.scale,
            layer.sliding_window,
            sinks=layer.sinks,
            num_decodes=layout.num_decodes,  # the layout puts single-token segments first
            max_seq_len=layout.max_seq_len,
        )
