"""The parts of an architecture beyond the dense Llama skeleton, as ``ModelArchConfig``
holds them: experts (``MoeConfig``), latent attention (``MlaConfig``), and the two kinds
of linear-attention layer (``LinearAttentionConfig``: the gated delta rule;
``Mamba2Config``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model (``moe.py``)."""

    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalize the top-k softmax weights to sum to 1
    routing_weights_in_model_dtype: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    # Per layer: the sparse MLP (True) or a dense one of ``intermediate_size`` (False).
    sparse_layers: tuple[bool, ...]
    # GPT-OSS: biases on the router and the experts, softmax over the top k logits (not
    # top k of the softmax: the same weights up to rounding), and the experts' SwiGLU
    # clamped: gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(alpha * gate).
    router_bias: bool = False
    expert_bias: bool = False
    softmax_over_top_k: bool = False
    # Qwen2-MoE's shared expert is gated per token by a sigmoid; Granite's is not (nor
    # DeepSeek's, which ``deepseek_scoring`` says).
    shared_expert_gated: bool = True
    # The experts' MLP: "swiglu" (gate and up rows), or Nemotron-H's "relu2" (up rows
    # alone, squared ReLU).
    expert_activation: str = "swiglu"
    swiglu_limit: float | None = None  # None: plain SwiGLU
    swiglu_alpha: float = 1.0
    # Nemotron 3 Super's latent experts: they run ``latent_size`` wide, between
    # ``fc1_latent_proj`` (hidden -> latent, after the router read the hidden states) and
    # ``fc2_latent_proj`` (latent -> hidden, after their weighted sum); None: hidden wide.
    latent_size: int | None = None
    # DeepSeek's router (None: the softmax-top-k one above). Scores are the softmax of the
    # logits (V2) or their sigmoids (V3, where a learned per-expert bias is added for the
    # choice only, not to the weights); the k experts are chosen within the best
    # ``topk_groups`` of ``num_groups`` equal groups (ranked by their best score, V2, or the
    # sum of their two best, V3); the weights (renormalized with ``norm_topk_prob``) are
    # multiplied by ``routed_scaling_factor``, in float32. The shared experts are ungated.
    deepseek_scoring: str | None = None  # "softmax" | "sigmoid"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Expert parallelism (``engine.expert_parallel``): the expert in each physical slot,
    # all ranks' in rank order (``engine/parallel/expert_placement.py``), of which rank
    # ``expert_rank`` holds its ``1 / num_expert_ranks``, whole; None: every expert.
    expert_placement: tuple[int, ...] | None = None
    expert_rank: int = 0
    num_expert_ranks: int = 1

    @property
    def local_experts(self) -> int:
        """The expert slots this rank holds."""
        if self.expert_placement is None:
            return self.num_experts
        return len(self.expert_placement) // self.num_expert_ranks


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention (``mla.py``). Each token caches one latent
    vector per layer: ``kv_lora_rank`` elements that every head's key and value are
    projections of (by ``kv_b_proj``), then ``qk_rope_head_dim`` of a rotated key part that
    every head shares."""

    q_lora_rank: int | None  # None: one q_proj (V2-Lite); else q_a_proj, a norm, q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The checkpoint's rotary dims come in pairs (x0, x1), (x2, x3), ... (DeepSeek's
    # layout): the loader reorders those rows to the halves layout ``rope.py`` rotates.
    rope_interleaved: bool = True

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


# The checkpoint's input projections of a linear-attention layer, in the fused one's order.
IN_PROJ_PARTS = ("qkv", "z", "b", "a")


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """Gated delta-rule layers (Qwen3.5's ``linear_attention``; ``gated_delta_net.py``):
    instead of a KV cache each keeps, per request, a convolution state (the last
    ``conv_kernel - 1`` inputs of its q/k/v channels) and a recurrent state
    (``num_value_heads`` matrices of ``key_head_dim x value_head_dim``), of a fixed size
    whatever the context's length."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]  # per layer: linear attention (else full attention)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_widths(self) -> tuple[int, int, int, int]:
        """Output rows of the layer's one input projection (``gated_delta_net.py``), the
        checkpoint's four fused in this order: ``in_proj_qkv`` (the convolution's
        channels), ``in_proj_z`` (the output gate), ``in_proj_b`` (beta) and
        ``in_proj_a`` (the decay), the last two one row per value head."""
        return (self.conv_dim, self.value_dim, self.num_value_heads, self.num_value_heads)

    def in_proj_start(self, which: str) -> int:
        """The fused projection's first row of the checkpoint's ``in_proj_{which}``."""
        index = IN_PROJ_PARTS.index(which)
        return sum(self.in_proj_widths[:index])

    @property
    def conv_shape(self) -> tuple[int, int]:
        """A request's convolution state in one layer: [channels, kernel - 1]."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """A request's recurrent state in one layer: [value heads, key dim, value dim]."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """Mamba-2 layers (Granite 4.0-H's and Nemotron-H's; ``mamba2.py``): per request a
    convolution state (the last ``conv_kernel - 1`` inputs of its x, B and C channels) and
    an SSM state (``num_heads`` matrices of ``head_dim x state_size``). The heads share
    B and C within ``num_groups`` groups; the output's gated RMSNorm normalizes each of
    those groups' channels on its own (``norm_group_size`` of them)."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    layers: tuple[bool, ...]  # per layer: Mamba-2 (else attention, or Nemotron-H's MLP)
    norm_group_size: int  # channels per norm group, the full model's (intermediate / groups)
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0  # time steps are clamped to [dt_min, dt_max] (time_step_limit)
    dt_max: float = math.inf
    # Tensor parallelism with fewer groups than ranks: each group's channels span this many
    # ranks (its B and C replicated on each), so its norm sums squares across them.
    group_ranks: int = 1

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def in_proj_widths(self) -> tuple[int, int, int]:
        """Output rows of ``in_proj``: the gate z, the convolution's channels (x, B, C),
        one time step per head."""
        return (self.intermediate_size, self.conv_dim, self.num_heads)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)
