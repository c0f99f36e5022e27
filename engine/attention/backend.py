"""The attention-backend interface: store this step's K/V into the paged cache and attend.

The model runner describes each step's flattened batch once (``BatchLayout``); the backend
turns it into whatever per-step metadata it needs (``build_metadata``), and every layer then
calls ``forward`` with that metadata. Backends are chosen by name from ``registry.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """One step's flattened batch: ``num_seqs`` query segments, ``num_tokens`` tokens.

    Segments with a single query token (decodes) come first: ``num_decodes`` of them.
    Tensors live on the engine's device; the ``*_cpu`` lists are host copies for loops.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What an attention layer tells the backend about itself."""

    scale: float
    sliding_window: int | None = None
    # [num_q_heads] (GPT-OSS): a logit per head that joins each row's softmax with no value.
    sinks: torch.Tensor | None = field(default=None, compare=False)
    # DeepSeek's latent attention (``models/mla.py``): the K and V slots hold the halves of
    # each token's latent vector, one KV head; keys are the whole latent (K then V slot,
    # ``2 * head_dim``, the query's width), values its first ``latent_dim`` elements, and
    # the output is [num_tokens, num_q_heads, latent_dim]. None: keys and values as stored.
    latent_dim: int | None = None


class AttentionBackend(ABC):
    """Contract: ``forward`` first writes ``key``/``value`` into ``kv_cache`` at
    ``layout.slot_mapping`` and then computes causal attention of ``query`` over each
    segment's whole context (cached prefix plus the new tokens). It must not modify any
    other slot of the cache and must return a fresh tensor."""

    name: str

    def build_metadata(self, layout: BatchLayout) -> object:
        """Per-step metadata shared by all layers. Default: the layout itself."""
        return layout

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: object,
        layer: LayerSpec,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim (or layer.latent_dim)]
        ...
