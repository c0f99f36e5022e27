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
    # [num_tokens] int32: per token, the end (exclusive) of the context positions it
    # attends to, where some token sees past its own position (an image's tokens see the
    # whole image: Gemma 3); None: causal (position + 1 each).
    key_ends: torch.Tensor | None = None

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
    # DeepSeek's latent attention (see ``LatentAttention``); None: keys and values as stored.
    latent: LatentAttention | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, eq=False)
class LatentAttention:
    """DeepSeek's multi-head latent attention as a layer hands it to a backend
    (``models/mla.py``). The cache holds one latent per token, ``[c_kv, k_pe]``
    (``kv_lora_rank + rope_dim``), its first half in the K slot and its second in the V
    slot of one KV head; ``key`` and ``value`` of ``forward`` are those halves. The query
    is each head's own ``[q_nope, q_pe]`` and the output each head's ``v_head_dim`` values.
    Head h's key is ``[W_uk[h] c_kv, k_pe]`` and its value ``W_uv[h] c_kv``. A backend
    attends in either of two equal forms, per segment:

    - *absorbed*: queries ``absorb``-ed into latent space attend over the latents
      themselves (MQA: keys the whole latent, values its first ``kv_lora_rank``), and the
      attended latents' ``values`` are the output; no per-head key is ever made.
    - *expanded*: the context's latents are ``expand``-ed into per-head keys and values,
      attended as multi-head attention (``qk`` and ``v`` wide instead of ``latent + rank``).

    Which costs less depends on the segment (``expanded_is_cheaper``): decodes absorb, a
    prompt's whole prefill expands."""

    w_uk: torch.Tensor  # [num_heads, nope_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [num_heads, v_head_dim, kv_lora_rank]
    rope_dim: int

    @property
    def kv_lora_rank(self) -> int:
        return self.w_uk.shape[2]

    @property
    def v_head_dim(self) -> int:
        return self.w_uv.shape[1]

    def absorb(self, query: torch.Tensor) -> torch.Tensor:
        """[T, H, nope + rope] -> [T, H, kv_lora_rank + rope]: ``[q_nope W_uk, q_pe]``."""
        q_nope, q_pe = query.split([self.w_uk.shape[1], self.rope_dim], dim=-1)
        return torch.cat((torch.einsum("thd,hdr->thr", q_nope, self.w_uk), q_pe), dim=-1)

    def values(self, latents: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora_rank] attended latents -> [T, H, v_head_dim] values."""
        return torch.einsum("thr,hvr->thv", latents, self.w_uv)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, kv_lora_rank + rope] -> (keys [L, H, nope + rope], values [L, H, v_head_dim])."""
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope = torch.einsum("lr,hdr->lhd", c_kv, self.w_uk)
        value = torch.einsum("lr,hvr->lhv", c_kv, self.w_uv)
        k_pe = k_pe[:, None, :].expand(-1, self.w_uk.shape[0], -1)
        return torch.cat((k_nope, k_pe), dim=-1), value

    def expanded_is_cheaper(self, query_len: int, seq_len: int) -> bool:
        """Whether the expanded form takes fewer multiply-adds for ``query_len`` queries
        over ``seq_len`` keys (per head): expanding costs ``(nope + v) x rank`` per key,
        absorbing the same per query, and each query-key pair costs ``nope + rope + v``
        expanded against ``2 x rank + rope`` absorbed. A whole prompt always expands;
        DeepSeek-V3's dims make a chunk after a long context expand from ~170 tokens."""
        nope, rank, v = self.w_uk.shape[1], self.kv_lora_rank, self.v_head_dim
        per_pair_saved = (2 * rank + self.rope_dim) - (nope + self.rope_dim + v)
        return (seq_len - query_len) * (nope + v) * rank < query_len * seq_len * per_pair_saved


class AttentionBackend(ABC):
    """Contract: ``forward`` first writes ``key``/``value`` into ``kv_cache`` at
    ``layout.slot_mapping`` and then computes causal attention of ``query`` over each
    segment's whole context (cached prefix plus the new tokens; up to ``layout.key_ends``
    where given). It must not modify any other slot of the cache and must return a fresh
    tensor."""

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
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim (latent: v_head_dim)]
        ...
