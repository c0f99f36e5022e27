"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2 and -V3, Kimi K2), over the
paged KV cache with one latent vector per token.

Each token's hidden state is projected to a latent ``c_kv`` (``kv_lora_rank`` elements,
normed) and a rotated key part ``k_pe`` (``qk_rope_head_dim``) that every head shares. Head
h's key is ``[W_uk[h] c_kv, k_pe]`` and its value ``W_uv[h] c_kv`` (``kv_b_proj`` holds
``W_uk`` and ``W_uv``). The cache keeps only ``[c_kv, k_pe]``: 576 elements per token and
layer in DeepSeek-V3 against 2 x 128 heads x 192 = 49152 for the keys and values it stands
for.

The layer hands the backend each head's own query ``[q_nope, q_pe]``, the latent (as the
cache's K and V halves) and ``W_uk`` / ``W_uv`` (``LatentAttention``), and gets each head's
values back. The backend attends per segment in the cheaper of two equal forms:
*absorbed* ("weight absorption"): head h's query becomes ``[q_nope[h] W_uk[h], q_pe[h]]``,
whose dot product with ``[c_kv, k_pe]`` is the query's with head h's key, so the heads
attend over the latents themselves (multi-query attention, keys the whole latent, values
its ``c_kv``) and the attended ``c_kv`` times ``W_uv[h]`` is the output: decodes, where it
reads 576 elements per token instead of expanding 128 heads' keys; *expanded*: the
context's latents become per-head keys and values (192 + 128 wide instead of 576 + 512 in
V3): a whole prompt's prefill, where the pairs outnumber the keys to expand.

The cache stores the latent in the layout every other model uses, one KV head of half the
latent in each of the K and V slots (``hf_config.kv_cache_heads``), so connectors, the CPU
tier, prefix caching and FP8 caches handle it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, LatentAttention, LayerSpec
from engine.models.arch import ModelArchConfig
from engine.models.norms import RMSNorm
from engine.models.rope import RotaryEmbedding

# DeepSeek's q_a_layernorm and kv_a_layernorm keep transformers' default epsilon, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.layer_idx = layer_idx
        self.num_heads = arch.num_q_heads
        self.nope_dim, self.rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = mla.kv_lora_rank, mla.v_head_dim
        qk_head_dim = self.nope_dim + self.rope_dim
        hidden = arch.hidden_size
        self.q_lora = mla.q_lora_rank is not None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=arch.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=arch.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=arch.o_bias)
        self.rotary = (rotary,)  # a tuple, so the shared table is not registered per layer
        self.backend = backend
        assert arch.attention_scale is not None
        self.scale = arch.attention_scale
        self.half = mla.latent_dim // 2  # the cache's head_dim: a latent fills K and V

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope, kv_lora_rank], W_uv [H, v_head_dim, kv_lora_rank]): views of
        ``kv_b_proj``'s weight, whose rows are per head the key's nope dims, then the
        value's (read each call: the loader fills parameters in place)."""
        weight = self.kv_b_proj.weight.view(
            self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank
        )
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, 1, latent_dim / 2]
        attn_metadata: object,
        lora: object = None,  # adapters on MLA models are refused at load
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        if self.q_lora:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            query = self.q_proj(hidden)
        query = query.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = query.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        c_kv = self.kv_a_layernorm(c_kv)  # [num_tokens, kv_lora_rank]
        q_pe, k_pe = self.rotary[0](positions, q_pe, k_pe[:, None, :])  # k_pe [T, 1, rope]
        query = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, nope + rope], rotated
        latent = torch.cat((c_kv[:, None, :], k_pe), dim=-1)  # [T, 1, latent_dim]
        key, value = latent[..., : self.half], latent[..., self.half :]  # the cache's halves
        w_uk, w_uv = self.up_projections()
        spec = LayerSpec(self.scale, latent=LatentAttention(w_uk, w_uv, self.rope_dim))
        out = self.backend.forward(query, key, value, kv_cache, attn_metadata, spec)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))


# Rows that hold rotary dims, by parameter: the query's (per head, after the nope dims)
# and the shared key part's (after the latent).
_ROPE_ROW_PARAMS = (
    "self_attn.q_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_proj_with_mqa.bias",
)


def rope_rows_in_halves(name: str, tensor: torch.Tensor, arch: ModelArchConfig) -> torch.Tensor:
    """``tensor`` (checkpoint parameter ``name``) with its rotary rows reordered from
    DeepSeek's pairs (x0, x1), (x2, x3), ... to halves (x0, x2, ..., x1, x3, ...), the
    layout ``rope.py`` rotates: rotating the halves of the reordered query and key equals
    rotating the pairs and reordering after (transformers' V3 path computes exactly that),
    and queries and keys reordered alike keep their dot products. Other tensors as they are."""
    mla = arch.mla
    assert mla is not None
    if not mla.rope_interleaved or not name.endswith(_ROPE_ROW_PARAMS):
        return tensor
    rope = mla.qk_rope_head_dim
    order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    if "kv_a_proj_with_mqa" in name:  # [kv_lora_rank + rope, ...]
        first = mla.kv_lora_rank
        return torch.cat((tensor[:first], tensor[first:][order]))
    per_head = tensor.view(arch.num_q_heads, mla.qk_nope_head_dim + rope, *tensor.shape[1:])
    nope = mla.qk_nope_head_dim
    return torch.cat((per_head[:, :nope], per_head[:, nope:][:, order]), dim=1).view(tensor.shape)
