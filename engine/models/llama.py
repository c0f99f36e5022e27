"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and their mixture-of-experts
variants: ``moe.py``) over a flattened, paged batch.

Tokens of all sequences in a step are one flat dimension; attention finds each sequence's
context through the backend's per-step metadata. q/k/v and gate/up projections are fused
into one matmul each; ``loader.py`` maps the checkpoint's separate tensors into them.
Projections take a step's LoRA deltas, row by row, when any request in it uses an adapter
(``lora.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, LayerSpec
from engine.models.arch import ModelArchConfig
from engine.models.lora import LoraBatch
from engine.models.moe import SparseMoe
from engine.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads = arch.num_q_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.qkv_proj = nn.Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.rotary = (rotary,)  # a tuple, so the shared table is not registered per layer
        self.backend = backend
        self.spec = LayerSpec(
            scale=arch.head_dim**-0.5, sliding_window=arch.sliding_windows[layer_idx]
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        attn_metadata: object,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            qkv = lora.apply(self.layer_idx, "qkv_proj", hidden, qkv)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.reshape(num_tokens, self.num_q_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotary[0](positions, query, key)
        out = self.backend.forward(query, key, value, kv_cache, attn_metadata, self.spec)
        out = out.reshape(num_tokens, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer_idx, "o_proj", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, intermediate_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.apply(self.layer_idx, "gate_up_proj", x, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        hidden = F.silu(gate) * up
        if lora is None:
            return self.down_proj(hidden)
        return lora.apply(self.layer_idx, "down_proj", hidden, self.down_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx, rotary, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: MLP | SparseMoe
        if arch.is_sparse(layer_idx):
            assert arch.moe is not None
            width = arch.moe.shared_expert_intermediate_size
            # The shared expert takes no adapter: the layer's LoRA targets are refused.
            shared = MLP(arch, layer_idx, width) if width else None
            # The triton backend runs the experts with the fused kernel too.
            self.mlp = SparseMoe(arch, shared, fused=backend.name == "triton")
        else:
            self.mlp = MLP(arch, layer_idx, arch.intermediate_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: object,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        residual = hidden
        hidden = self.self_attn(
            positions, self.input_layernorm(hidden), kv_cache, attn_metadata, lora
        )
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden), lora)
        return residual + hidden


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, rotary, backend) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, arch: ModelArchConfig, max_positions: int, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.arch = arch
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions)
        self.model = LlamaModel(arch, self.rotary, backend)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, Hkv, D]
        attn_metadata: object,
        lora: LoraBatch | None = None,  # None: no row uses an adapter
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        hidden = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, attn_metadata, lora)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
