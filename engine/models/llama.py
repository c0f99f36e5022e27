"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, their mixture-of-experts
variants: ``moe.py``, and Gemma 3, GPT-OSS and DeepSeek-V2/V3, whose differences
``ModelArchConfig`` lists; DeepSeek's latent attention is ``mla.py``; hybrid models'
linear attention ``gated_delta_net.py`` and ``mamba2.py``; Nemotron-H's one-block layers
``SingleBlockLayer``) over a flattened, paged batch.

Tokens of all sequences in a step are one flat dimension; attention finds each sequence's
context through the backend's per-step metadata. q/k/v and gate/up projections are fused
into one matmul each; ``loader.py`` maps the checkpoint's separate tensors into them.
Projections take a step's LoRA deltas, row by row, when any request in it uses an adapter
(``lora.py``).

Under tensor parallelism (``engine/parallel``) ``arch`` is one rank's shard
(``shard_spec.local_arch``: its heads, its slice of each MLP width): attention and MLP
blocks then produce partial sums, which each layer adds up across ranks (``group``) before
the residual. The embeddings and the LM head are split by vocabulary: each rank embeds
the ids in its range (an all-reduce assembles the rows) and computes its range's logits
(rank 0 gathers them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, LayerSpec
from engine.linear_state import LinearLayerState
from engine.models.arch import ModelArchConfig
from engine.models.gated_delta_net import GatedDeltaNet
from engine.models.lora import LoraBatch
from engine.models.mamba2 import Mamba2Mixer
from engine.models.mla import MlaAttention
from engine.models.moe import SparseMoe
from engine.models.norms import SplitRMSNorm, rms_norm
from engine.models.rope import RotaryEmbedding
from engine.models.rope_config import RopeConfig
from engine.parallel.group import SingleRank, TPGroup


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads = arch.num_q_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        # Qwen3.5: each head's query rows are followed by as many rows of its output gate.
        self.output_gate = arch.attention_output_gate
        self.q_rows = arch.q_size * (2 if self.output_gate else 1)
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_rows + 2 * arch.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = rms_norm(arch, arch.head_dim)
            self.k_norm = rms_norm(arch, arch.head_dim)
        self.qk_norm = arch.qk_norm
        self.qk_norm_whole = arch.qk_norm_whole
        if arch.qk_norm_whole:  # MiniMax-M2: over all of this rank's heads and the others'
            group = group or SingleRank()
            self.q_norm = SplitRMSNorm(arch.q_size, arch.rms_norm_eps, group)
            self.k_norm = SplitRMSNorm(arch.kv_size, arch.rms_norm_eps, group)
        self.rotary = (rotary,)  # a tuple, so the shared table is not registered per layer
        self.nope = arch.nope  # no rotary positions (Granite 4.0-H)
        self.backend = backend
        scale = arch.attention_scale if arch.attention_scale is not None else arch.head_dim**-0.5
        self.spec = LayerSpec(scale=scale, sliding_window=arch.sliding_windows[layer_idx])
        # GPT-OSS: one logit per query head (passed each call: the loader replaces params).
        self.sinks = nn.Parameter(torch.empty(arch.num_q_heads)) if arch.attention_sinks else None
        # (k_scale, v_scale): the checkpoint's calibrated FP8 KV-cache scales, set by the
        # model shard when its cache is FP8 (``use_kv_scales``); None: stored unscaled.
        self.kv_scales: tuple[float, float] | None = None

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
        query, key, value = qkv.split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:  # [N, heads, 2 * head_dim]: each head's query, then its gate
            query, gate = query.view(num_tokens, self.num_q_heads, -1).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, self.q_size)
        if self.qk_norm_whole:
            query, key = self.q_norm(query), self.k_norm(key)
        query = query.reshape(num_tokens, self.num_q_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        if not self.nope:
            query, key = self.rotary[0](positions, query, key)
        spec = self.spec
        if self.sinks is not None:
            spec = LayerSpec(spec.scale, spec.sliding_window, self.sinks)
        if self.kv_scales is not None:
            # The cache holds K / k_scale and V / v_scale; attention over the stored values
            # folds k_scale into the softmax scale and v_scale into the output (both are
            # per-layer constants), so no backend reads scales.
            k_scale, v_scale = self.kv_scales
            # In float32: the store rounds the quotient to FP8 once (a 16-bit quotient
            # would round twice, one FP8 step off for ~3% of elements).
            key, value = key.float() / k_scale, value.float() / v_scale
            spec = LayerSpec(spec.scale * k_scale, spec.sliding_window, spec.sinks)
        out = self.backend.forward(query, key, value, kv_cache, attn_metadata, spec)
        if self.kv_scales is not None:
            out = out * self.kv_scales[1]
        out = out.reshape(num_tokens, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
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
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma); else SwiGLU

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.apply(self.layer_idx, "gate_up_proj", x, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        hidden = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        if lora is None:
            return self.down_proj(hidden)
        return lora.apply(self.layer_idx, "down_proj", hidden, self.down_proj(hidden))


class UngatedMLP(nn.Module):
    """Nemotron-H's MLP: ``down(relu(up(x)) ** 2)``, no gate."""

    def __init__(self, arch: ModelArchConfig, layer_idx: int, intermediate_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.up_proj = nn.Linear(arch.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        up = self.up_proj(x)
        if lora is not None:
            up = lora.apply(self.layer_idx, "up_proj", x, up)
        hidden = F.relu(up).square()
        if lora is None:
            return self.down_proj(hidden)
        return lora.apply(self.layer_idx, "down_proj", hidden, self.down_proj(hidden))


def feed_forward(
    arch: ModelArchConfig, layer_idx: int, backend: AttentionBackend
) -> MLP | UngatedMLP | SparseMoe:
    """Layer ``layer_idx``'s MLP: the experts (and their shared expert, when the model has
    one) where the layer is sparse, else a dense MLP; gated, or Nemotron-H's ungated
    squared-ReLU ones (``hidden_act`` "relu2")."""

    def dense(width: int) -> MLP | UngatedMLP:
        if arch.hidden_act == "relu2":
            return UngatedMLP(arch, layer_idx, width)
        return MLP(arch, layer_idx, width)

    if not arch.is_sparse(layer_idx):
        return dense(arch.intermediate_size)
    assert arch.moe is not None
    width = arch.moe.shared_expert_intermediate_size
    # The shared expert takes no adapter: the layer's LoRA targets are refused. The triton
    # backend runs the experts with the fused kernel too.
    return SparseMoe(arch, dense(width) if width else None, fused=backend.name == "triton")


class SingleBlockLayer(nn.Module):
    """A layer that is one block (Nemotron-H's): ``x + block(norm(x))``, the block being
    Mamba-2, attention, an MLP or experts (``ModelArchConfig.block_kinds``), named as the
    other layers' blocks are (``mamba``, ``self_attn``, ``mlp``; the loader renames the
    checkpoint's ``mixer``). An MLP or MoE layer has no cache (its ``kv_cache`` is None)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        group: TPGroup,
    ) -> None:
        super().__init__()
        self.group = group
        self.kind = arch.block_kinds[layer_idx]
        self.input_layernorm = rms_norm(arch, arch.hidden_size)
        if self.kind == "mamba":
            self.mamba = Mamba2Mixer(arch, layer_idx, group)
        elif self.kind == "attention":
            self.self_attn = Attention(arch, layer_idx, rotary, backend, group)
        else:  # an MLP, or Nemotron 3's experts (``arch.is_sparse``)
            self.mlp = feed_forward(arch, layer_idx, backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor | LinearLayerState | None,
        attn_metadata: object,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        if self.kind == "mamba":
            assert isinstance(kv_cache, LinearLayerState)
            out = self.mamba(normed, kv_cache, lora)
        elif self.kind == "attention":
            out = self.self_attn(positions, normed, kv_cache, attn_metadata, lora)
        else:
            out = self.mlp(normed, lora)
        return hidden + self.group.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks. With ``sandwich_norms`` (Gemma) each block's output is
    normed too; the checkpoint then names the attention block's output norm
    ``post_attention_layernorm`` and the MLP's ``pre_``/``post_feedforward_layernorm``.
    Each block's output is summed over the tensor-parallel ``group`` (a no-op alone)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        group: TPGroup,
    ) -> None:
        super().__init__()
        self.group = group
        self.sandwich_norms = arch.sandwich_norms
        self.input_layernorm = rms_norm(arch, arch.hidden_size)
        # The token mixer: attention, or a hybrid model's linear attention (named as the
        # checkpoints name it: Qwen3.5's ``linear_attn``, Granite 4.0-H's ``mamba``).
        self.linear = arch.is_linear(layer_idx)
        self.residual_multiplier = arch.residual_multiplier  # Granite's; else 1
        self.mixer_name = "self_attn"
        if self.linear and arch.mamba2 is not None:
            self.mixer_name = "mamba"
            self.mamba = Mamba2Mixer(arch, layer_idx, group)
        elif self.linear:
            self.mixer_name = "linear_attn"
            self.linear_attn = GatedDeltaNet(arch, layer_idx)
        else:
            self.self_attn: Attention | MlaAttention = (
                MlaAttention(arch, layer_idx, rotary, backend)
                if arch.mla is not None
                else Attention(arch, layer_idx, rotary, backend, group)
            )
        self.post_attention_layernorm = rms_norm(arch, arch.hidden_size)
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm(arch, arch.hidden_size)
            self.post_feedforward_layernorm = rms_norm(arch, arch.hidden_size)
        self.mlp = feed_forward(arch, layer_idx, backend)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor | LinearLayerState,  # a linear-attention layer's: its states
        attn_metadata: object,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        reduce = self.group.all_reduce
        residual = hidden
        normed = self.input_layernorm(hidden)
        if self.linear:
            assert isinstance(kv_cache, LinearLayerState)
            hidden = reduce(getattr(self, self.mixer_name)(normed, kv_cache, lora))
        else:
            hidden = reduce(self.self_attn(positions, normed, kv_cache, attn_metadata, lora))
        if self.sandwich_norms:
            hidden = residual + self.post_attention_layernorm(hidden)
            mlp_out = reduce(self.mlp(self.pre_feedforward_layernorm(hidden), lora))
            return hidden + self.post_feedforward_layernorm(mlp_out)
        hidden = residual + self._scaled(hidden)
        return hidden + self._scaled(reduce(self.mlp(self.post_attention_layernorm(hidden), lora)))

    def _scaled(self, block_out: torch.Tensor) -> torch.Tensor:
        """A block's output as the residual stream takes it (Granite scales it)."""
        if self.residual_multiplier == 1.0:
            return block_out
        return block_out * self.residual_multiplier


class VocabEmbedding(nn.Module):
    """Token embeddings of rank ``group.rank``'s vocabulary slice: ids
    ``start .. start + rows`` (the last rank's slice is padded with zero rows when the
    vocabulary does not split evenly). Alone, a plain embedding of the whole vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.rows = -(-vocab_size // group.size)
        self.start = group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        rows = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        return self.group.all_reduce(rows.masked_fill_(outside[:, None], 0))


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        rotaries: dict[RopeConfig, RotaryEmbedding],
        backend: AttentionBackend,
        group: TPGroup,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, group)
        layer_type = SingleBlockLayer if arch.block_kinds else DecoderLayer
        self.layers = nn.ModuleList(
            layer_type(arch, i, rotaries[arch.rope_of(i)], backend, group)
            for i in range(arch.num_layers)
        )
        self.norm = rms_norm(arch, arch.hidden_size)
        # Multi-token-prediction layers, when the engine drafts with them (``mtp.py``).
        self.mtp_layers = nn.ModuleList()


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        max_positions: int,
        backend: AttentionBackend,
        group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        group = group or SingleRank()
        self.arch = arch
        # One cos/sin table per distinct rotary (Gemma 3: the full and the sliding layers').
        ropes = dict.fromkeys(arch.rope_of(i) for i in range(arch.num_layers))
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(rope, arch.rotary_dim, max_positions) for rope in ropes
        )
        self.model = LlamaModel(arch, dict(zip(ropes, self.rotaries, strict=True)), backend, group)
        self.group = group
        # False for a checkpoint without a head (an embedding model's): no logits.
        self.generates = True
        # layer -> (k_scale, v_scale) stored in the checkpoint (loader.py); used only with
        # an FP8 KV cache (``use_kv_scales``).
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        # Why the checkpoint's KV-cache scales cannot serve an FP8 cache (kv_scales.py).
        self.kv_scale_problems: tuple[str, ...] = ()
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:  # this rank's vocabulary slice, as the embeddings'
            rows = self.model.embed_tokens.rows
            self.lm_head = nn.Linear(arch.hidden_size, rows, bias=False)

    def build_rope_tables(self, device: torch.device) -> None:
        for rotary in self.rotaries:
            rotary.build_tables(device)

    def rotary_of(self, layer_idx: int) -> RotaryEmbedding:
        ropes = list(dict.fromkeys(self.arch.rope_of(i) for i in range(self.arch.num_layers)))
        return self.rotaries[ropes.index(self.arch.rope_of(layer_idx))]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list,  # per layer [num_blocks, 2, block_size, Hkv, D] or LinearLayerState
        attn_metadata: object,
        lora: LoraBatch | None = None,  # None: no row uses an adapter
        images: tuple[torch.Tensor, torch.Tensor] | None = None,  # see hidden_and_aux
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        hidden, _ = self.hidden_and_aux(
            input_ids, positions, kv_caches, attn_metadata, lora, images=images
        )
        return self.model.norm(hidden)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer (not the MTP layer's)
        attn_metadata: object,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], before the final norm
        return self.hidden_and_aux(input_ids, positions, kv_caches, attn_metadata, lora)[0]

    def hidden_and_aux(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # one per layer (not a drafting layer's)
        attn_metadata: object,
        lora: LoraBatch | None = None,
        aux_layer_ids: tuple[int, ...] = (),
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``hidden_states``, and the residual stream entering each layer of
        ``aux_layer_ids`` (0: the embeddings; ``num_layers``: the last layer's output), in
        their order ([num_tokens, hidden_size] each): what an EAGLE-3 head reads.
        ``images``: (rows [m], embeddings [m, (1 + K) * hidden]) of a vision-language
        model's image placeholders: the first slice replaces those rows' token embeddings;
        with DeepStack (Qwen3-VL: ``VisionSpec.deepstack`` = K) slice i + 1 is added to
        those rows of layer i's output."""
        seen: dict[int, torch.Tensor] = {}
        hidden = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale != 1.0:
            # As transformers: the scale rounded to the model dtype (bf16: sqrt(3072) = 55.5).
            hidden = hidden * torch.tensor(self.arch.embed_scale, dtype=hidden.dtype)
        if self.arch.embedding_multiplier != 1.0:  # Granite: a Python float, as transformers
            hidden = hidden * self.arch.embedding_multiplier
        deepstack: list[torch.Tensor] = []
        if images is not None:
            rows, embeds = images
            slices = embeds.to(hidden.dtype).split(hidden.shape[-1], dim=-1)
            hidden = hidden.index_copy(0, rows, slices[0])
            deepstack = list(slices[1:])
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if index in aux_layer_ids:
                seen[index] = hidden
            hidden = layer(positions, hidden, kv_cache, attn_metadata, lora)
            if index < len(deepstack):
                hidden = hidden.index_add(0, rows, deepstack[index])
        seen[len(kv_caches)] = hidden
        return hidden, [seen[index] for index in aux_layer_ids]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        """Under tensor parallelism every rank calls this on the same rows (it gathers the
        vocabulary slices); rank 0's result is the one to use."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        if self.arch.logits_divisor != 1.0:  # Granite's logits_scaling, in the model dtype
            logits = logits / self.arch.logits_divisor
        logits = logits.float()
        if self.group.size > 1:  # [n, rows] per rank -> [n, vocab], the padding cut off
            logits = torch.cat(self.group.all_gather(logits), dim=-1)[:, : self.arch.vocab_size]
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def use_kv_scales(model: LlamaForCausalLM) -> int:
    """Make each attention layer store K/V divided by the checkpoint's calibrated scales
    (for an FP8 cache); layers without them store K/V as they are. Returns how many
    layers use them: latent attention (MLA) stores its latent unscaled, and a
    linear-attention layer has no KV cache, so their scales (or a layer index past the
    model's) go unused."""
    used = 0
    for index, layer in enumerate(model.model.layers):
        if isinstance(getattr(layer, "self_attn", None), Attention):
            layer.self_attn.kv_scales = model.checkpoint_kv_scales.get(index)
            used += layer.self_attn.kv_scales is not None
    return used
