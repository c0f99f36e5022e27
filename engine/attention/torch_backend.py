"""Attention in plain torch: works on every device. Decodes run as one padded batch, short
segments (a decode with the draft tokens it verifies: at most ``SHORT_QUERY_LEN`` tokens)
as another, and the other prompt segments one at a time through
``scaled_dot_product_attention`` (with ``BatchLayout.key_ends``, all but the decodes).

Per-step work (the masks) is done once in ``build_metadata``, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine_config import MAX_SPECULATIVE_TOKENS
from engine.attention.backend import AttentionBackend, BatchLayout, LatentAttention, LayerSpec
from kernels import reference

# Segments up to this many query tokens, right after the decodes (the model runner orders
# segments by length), are batched together.
SHORT_QUERY_LEN = 1 + MAX_SPECULATIVE_TOKENS


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


@dataclass(slots=True)
class ShortSegments:
    """Segments ``first .. first + num_seqs`` of the batch, padded to ``max_query_len``."""

    first: int
    num_seqs: int
    max_query_len: int
    num_key_slots: int
    query_lens: torch.Tensor  # [num_seqs] int64
    padded_rows: torch.Tensor  # [their tokens] int64: row of each in the padded batch
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class TorchMetadata:
    layout: BatchLayout
    num_decode_key_slots: int
    short: ShortSegments | None = None
    # sliding window (None: full) → additive float mask [num_decodes, 1, 1, key slots]
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        mask = self.decode_masks.get(sliding_window)
        if mask is None:
            seq_lens = self.layout.seq_lens[: self.layout.num_decodes]
            allowed = reference.decode_mask(seq_lens, self.num_decode_key_slots, sliding_window)
            mask = self.decode_masks[sliding_window] = _additive(allowed, dtype)
        return mask

    def short_mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        short = self.short
        assert short is not None
        mask = short.masks.get(sliding_window)
        if mask is None:
            end = short.first + short.num_seqs
            allowed = reference.short_query_mask(
                self.layout.seq_lens[short.first : end], short.query_lens,
                short.max_query_len, short.num_key_slots, sliding_window,
            )  # fmt: skip
            mask = short.masks[sliding_window] = _additive(allowed, dtype)
        return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # The batched paths' K/V gathers reuse its buffers across layers and steps.
        self.workspace = reference.GatherWorkspace()

    def build_metadata(self, layout: BatchLayout) -> TorchMetadata:
        num_decodes = layout.num_decodes
        max_decode_len = max(layout.seq_lens_cpu[:num_decodes], default=0)
        num_slots = -(-max_decode_len // self.block_size) * self.block_size
        # Short segments are batched under causal masks only: a step whose images attend
        # both ways (``layout.key_ends``) runs them one at a time.
        short = self._short_segments(layout) if layout.key_ends is None else None
        return TorchMetadata(layout, num_slots, short)

    def _short_segments(self, layout: BatchLayout) -> ShortSegments | None:
        """The short segments right after the decodes, if there are two or more (one
        goes as fast through the per-segment path)."""
        starts = layout.query_start_loc_cpu
        first = end = layout.num_decodes
        while end < layout.num_seqs and starts[end + 1] - starts[end] <= SHORT_QUERY_LEN:
            end += 1
        if end - first < 2:
            return None
        lens = [starts[i + 1] - starts[i] for i in range(first, end)]
        max_query_len = max(lens)
        rows = [i * max_query_len + j for i, n in enumerate(lens) for j in range(n)]
        max_seq_len = max(layout.seq_lens_cpu[first:end])
        device = layout.seq_lens.device
        return ShortSegments(
            first=first,
            num_seqs=end - first,
            max_query_len=max_query_len,
            num_key_slots=-(-max_seq_len // self.block_size) * self.block_size,
            query_lens=torch.tensor(lens, dtype=torch.int64).to(device),
            padded_rows=torch.tensor(rows, dtype=torch.int64).to(device),
        )

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
        latent = layer.latent
        # Latent attention's decodes and short segments attend absorbed: queries into
        # latent space, the attended latents back to values.
        absorb = (lambda q: q) if latent is None else latent.absorb
        values = (lambda o: o) if latent is None else latent.values
        latent_dim = None if latent is None else latent.kv_lora_rank
        num_decodes = layout.num_decodes
        out = query.new_empty(*query.shape[:2], query.shape[-1] if latent is None
                              else latent.v_head_dim)  # fmt: skip
        if num_decodes:
            out[:num_decodes] = values(reference.decode_attention(
                absorb(query[:num_decodes]),
                kv_cache,
                layout.seq_lens[:num_decodes],
                layout.block_table[:num_decodes],
                layer.scale,
                layer.sliding_window,
                attn_mask=metadata.decode_mask(layer.sliding_window, query.dtype),
                sinks=layer.sinks,
                latent_dim=latent_dim,
                workspace=self.workspace,
            ))  # fmt: skip
        first_long = num_decodes
        short = metadata.short
        if short is not None:
            first_long = short.first + short.num_seqs
            start, end = (
                layout.query_start_loc_cpu[short.first],
                layout.query_start_loc_cpu[first_long],
            )
            out[start:end] = values(reference.short_query_attention(
                absorb(query[start:end]),
                kv_cache,
                short.padded_rows,
                layout.seq_lens[short.first : first_long],
                layout.block_table[short.first : first_long],
                layer.scale,
                attn_mask=metadata.short_mask(layer.sliding_window, query.dtype),
                sinks=layer.sinks,
                latent_dim=latent_dim,
                workspace=self.workspace,
            ))  # fmt: skip
        if first_long == layout.num_seqs:
            return out
        start = layout.query_start_loc_cpu[first_long]
        if latent is not None:
            latent_segments(query, kv_cache, layout, first_long, layer.scale, latent, out)
            return out
        out[start:] = reference.paged_attention(
            query[start:],
            kv_cache,
            layout.query_start_loc[first_long:] - start,
            layout.seq_lens[first_long:],
            layout.block_table[first_long:],
            layer.scale,
            layer.sliding_window,
            layer.sinks,
            key_ends=None if layout.key_ends is None else layout.key_ends[start:],
        )
        return out


def latent_segments(
    query: torch.Tensor,  # [num_tokens, H, nope + rope]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, 1, latent_dim / 2]
    layout: BatchLayout,
    first: int,
    scale: float,
    latent: LatentAttention,
    out: torch.Tensor,  # [num_tokens, H, v_head_dim], written in place
) -> None:
    """Latent attention of segments ``first ..`` of the batch, one at a time, each in the
    form that costs less (``LatentAttention.expanded_is_cheaper``): a whole prompt expands,
    a short chunk after a long cached context absorbs. (Both backends' prompt path.)"""
    starts, block_size = layout.query_start_loc_cpu, kv_cache.shape[2]
    for i in range(first, layout.num_seqs):
        q_start, q_end, seq_len = starts[i], starts[i + 1], layout.seq_lens_cpu[i]
        if q_start == q_end:
            continue
        block_ids = layout.block_table[i, : -(-seq_len // block_size)].long()
        if latent.expanded_is_cheaper(q_end - q_start, seq_len):
            out[q_start:q_end] = reference.expanded_latent_attention(
                query[q_start:q_end], kv_cache, block_ids, seq_len, scale, latent.expand
            )
            continue
        segment = reference.paged_attention(
            latent.absorb(query[q_start:q_end]),
            kv_cache,
            layout.query_start_loc.new_tensor([0, q_end - q_start]),
            layout.seq_lens[i : i + 1],
            block_ids[None],
            scale,
            latent_dim=latent.kv_lora_rank,
        )
        out[q_start:q_end] = latent.values(segment)
