"""Which architectures the engine serves, and what sets each apart from the Llama
skeleton (``ArchFlags``): one row per ``architectures`` name a config.json may give, and
the ``model_type`` each older config without it maps to (``BY_MODEL_TYPE``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchFlags:
    """How one architecture departs from Llama's (every flag off: Llama itself)."""

    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    # Qwen2-MoE adds a shared expert, gated per token by a sigmoid, to the routed ones.
    shared_expert: bool = False
    # Qwen's routers cast the top-k weights to the model dtype before weighting the
    # experts' outputs; Mixtral's keeps them in float32 (same in float32, not in bf16).
    routing_weights_in_model_dtype: bool = True
    # Default of norm_topk_prob when config.json leaves it out (transformers' configs).
    norm_topk_prob: bool = False
    gemma3: bool = False  # see ModelArchConfig's Gemma 3 fields
    # Phi-3's rope: reads partial_rotary_factor, and its legacy "su"/"yarn" mean longrope.
    phi3_rope: bool = False
    gpt_oss: bool = False  # attention sinks, biased router and experts, clamped SwiGLU
    # 2 or 3: DeepSeek-V2's or -V3's router (``MoeConfig.deepseek_scoring``), with ungated
    # shared experts and dense first layers; GLM-4.5 routes as V3.
    deepseek_router: int = 0
    latent_attention: bool = False  # DeepSeek's MLA (``MlaConfig``)
    # GLM-4.5: partial_rotary_factor read (as Phi-3, without its longrope names), q/k
    # RMSNorm as use_qk_norm says, attention_bias on q/k/v only.
    glm4_moe: bool = False
    # MiniMax-M2: q/k RMSNorm over each token's whole projection (all heads at once), a
    # partial rotary (its configs' rotary_dim), experts intermediate_size wide.
    minimax_m2: bool = False
    # Qwen3.5: gated delta-rule (linear attention) layers between full-attention ones
    # (``LinearAttentionConfig``), a sigmoid gate on the attention output, RMSNorm by
    # 1 + weight, a partial rotary.
    qwen3_5: bool = False
    # Granite: the embeddings, each block's output and the logits scaled by the config's
    # multipliers, attention scaled by attention_multiplier.
    granite: bool = False
    # Granite 4.0-H: Mamba-2 layers between full-attention ones (``Mamba2Config``), each
    # layer's MLP a shared one (plus routed experts when the config has any), attention
    # maybe without rotary positions.
    granite_hybrid: bool = False
    # Nemotron-H: each layer one block (``ModelArchConfig.block_kinds``): Mamba-2,
    # rotary-free attention or a squared-ReLU MLP; norm gains multiplied in float32.
    nemotron_h: bool = False
    # Bamba: Granite 4.0-H's layout (``hf_config._bamba`` reads it into Granite's keys)
    # with rotary attention over ``partial_rotary_factor`` of each head.
    bamba: bool = False


ARCHITECTURES: dict[str, ArchFlags] = {
    "LlamaForCausalLM": ArchFlags(),
    "MistralForCausalLM": ArchFlags(),
    "Qwen2ForCausalLM": ArchFlags(qkv_bias=True),
    "Qwen3ForCausalLM": ArchFlags(qk_norm=True),
    # Mixtral always renormalizes its top-k weights (it has no norm_topk_prob key).
    "MixtralForCausalLM": ArchFlags(
        moe=True, routing_weights_in_model_dtype=False, norm_topk_prob=True
    ),
    "Qwen2MoeForCausalLM": ArchFlags(qkv_bias=True, moe=True, shared_expert=True),
    "Qwen3MoeForCausalLM": ArchFlags(qk_norm=True, moe=True),
    # Qwen3-VL-MoE's language model: Qwen3-MoE's, whose router always renormalizes (its
    # config has no norm_topk_prob); its experts stored stacked (``stacked_experts.py``).
    "Qwen3VLMoeForConditionalGeneration": ArchFlags(qk_norm=True, moe=True, norm_topk_prob=True),
    "Qwen3_5ForCausalLM": ArchFlags(qk_norm=True, qwen3_5=True),
    "Qwen3_5ForConditionalGeneration": ArchFlags(qk_norm=True, qwen3_5=True),
    # Qwen3.5's mixture of experts: every layer sparse, a sigmoid-gated shared expert beside
    # the routed ones (Qwen2-MoE's), whose top-k weights are always renormalized.
    "Qwen3_5MoeForCausalLM": ArchFlags(
        qk_norm=True, qwen3_5=True, moe=True, shared_expert=True, norm_topk_prob=True
    ),
    "Qwen3_5MoeForConditionalGeneration": ArchFlags(
        qk_norm=True, qwen3_5=True, moe=True, shared_expert=True, norm_topk_prob=True
    ),
    # Qwen3-Next: Qwen3.5-MoE's layers, the delta-rule layer's input projections stored
    # as two, interleaved per key head (``loader._qwen3_next_in_proj``); its router
    # renormalizes as its config says.
    "Qwen3NextForCausalLM": ArchFlags(qk_norm=True, qwen3_5=True, moe=True, shared_expert=True),
    # Granite 3.x: Llama with multipliers.
    "GraniteForCausalLM": ArchFlags(granite=True),
    # Granite 4.0-H: see ArchFlags.granite_hybrid; experts only where num_local_experts > 0.
    "GraniteMoeHybridForCausalLM": ArchFlags(granite=True, granite_hybrid=True),
    "NemotronHForCausalLM": ArchFlags(nemotron_h=True),
    "BambaForCausalLM": ArchFlags(granite=True, granite_hybrid=True, bamba=True),
    # Phi-3 / Phi-4: Llama with fused qkv_proj and gate_up_proj in the checkpoint (loaded as
    # they are) and maybe a partial rotary.
    "Phi3ForCausalLM": ArchFlags(phi3_rope=True),
    # GPT-OSS: attention with biases and sinks on alternating windowed / full layers, YaRN;
    # its router picks the top k logits and softmaxes over them (in the model dtype).
    "GptOssForCausalLM": ArchFlags(moe=True, gpt_oss=True),
    "Gemma3ForCausalLM": ArchFlags(qk_norm=True, gemma3=True),
    # The multimodal checkpoint's language model; the loader skips the vision weights.
    "Gemma3ForConditionalGeneration": ArchFlags(qk_norm=True, gemma3=True),
    # Latent attention; shared experts beside routed ones, picked within groups of experts.
    "DeepseekV2ForCausalLM": ArchFlags(moe=True, deepseek_router=2, latent_attention=True),
    "DeepseekV3ForCausalLM": ArchFlags(
        moe=True, deepseek_router=3, latent_attention=True, norm_topk_prob=True
    ),
    # GLM-4.5 / 4.6 (and -Air): GQA attention with a partial rotary, DeepSeek-V3's router.
    "Glm4MoeForCausalLM": ArchFlags(
        moe=True, deepseek_router=3, norm_topk_prob=True, glm4_moe=True
    ),
    # MiniMax-M2: GQA with whole-projection q/k norms, V3's router without groups or shared
    # experts, every layer sparse.
    "MiniMaxM2ForCausalLM": ArchFlags(
        moe=True, deepseek_router=3, norm_topk_prob=True, minimax_m2=True
    ),
}

BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    # Qwen2.5-VL's language model: transformers 4's flat config, and 5's text_config.
    "qwen2_5_vl": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl": "Qwen3ForCausalLM",  # Qwen3-VL's: Qwen3's (q/k norms)
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "bamba": "BambaForCausalLM",
}
