"""Attention through the Triton kernels: one KV-store launch, then one decode launch (split-KV
when the batch is small and contexts long) and one prefill launch for the prompt chunks.

Runs on CUDA; on the CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``kernels`` is imported), which the tests use. Sliding windows are supported. DeepSeek's
latent attention decodes through its own kernel (``kernels/mla_decode.py``); its prompts run
as on the torch backend.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, BatchLayout, LatentAttention, LayerSpec
from engine.attention.torch_backend import latent_segments
from kernels.kv_store import store_kv
from kernels.mla_decode import mla_decode
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
        store_kv(key, value, kv_cache, layout.slot_mapping)
        if layer.latent is not None:
            return self._latent(query, kv_cache, layout, layer.scale, layer.latent)
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
            key_ends=layout.key_ends,
        )

    def _latent(
        self,
        query: torch.Tensor,  # [num_tokens, H, nope + rope]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, 1, latent_dim / 2]
        layout: BatchLayout,
        scale: float,
        latent: LatentAttention,
    ) -> torch.Tensor:  # [num_tokens, H, v_head_dim]
        """DeepSeek's latent attention: the decodes absorbed through the MLA decode kernel
        (``kernels/mla_decode.py``), the other segments as the torch backend runs them
        (prompts expanded through SDPA)."""
        out = query.new_empty(*query.shape[:2], latent.v_head_dim)
        num_decodes = layout.num_decodes
        if num_decodes:
            out[:num_decodes] = latent.values(mla_decode(
                latent.absorb(query[:num_decodes]), kv_cache, layout.seq_lens[:num_decodes],
                layout.block_table[:num_decodes], scale, latent.kv_lora_rank,
                max_seq_len=layout.max_seq_len,
            ))  # fmt: skip
        if num_decodes < layout.num_seqs:
            latent_segments(query, kv_cache, layout, num_decodes, scale, latent, out)
        return out
