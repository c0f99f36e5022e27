"""Write random-weight checkpoints of real architectures, with an offline-trained tokenizer.

``make_model("llama", "tiny", out)`` builds the model with ``transformers`` (so the files
are exactly what a real checkpoint of that architecture looks like), scales the random
weights so that logits are well separated (greedy decoding is then stable under float
rounding, which makes token-exact parity tests meaningful), and saves config.json,
generation_config.json, model.safetensors and the tokenizer with a ChatML chat template
(``qwen3`` and ``qwen3_moe``: with Qwen3's ``<think>`` tags, a template that opens the
thinking). The MoE archs (``mixtral``, ``qwen2_moe``, ``qwen3_moe``) have 8 experts of half
the dense MLP's width and route each token to 2, so their work per token is the dense
model's. ``gemma3`` is Gemma 3's text model (``Gemma3ForCausalLM``; see ``_gemma3_config``),
``phi3`` Phi-4-mini's layout (fused projections in the files, a partial rotary), ``gpt_oss``
GPT-OSS unquantized (see ``_gpt_oss_config``), whose tokenizer has the Harmony markers and
a template of that format (the router reads its replies in it: ``router/harmony.py``).
``deepseek_v2`` and ``deepseek_v3`` are DeepSeek's latent attention and routers (see
``_deepseek_config``), ``glm4_moe`` GLM-4.5's layout (see ``_glm4_moe_config``),
``minimax_m2`` MiniMax-M2's (see ``_minimax_m2_config``), ``llava`` a LLaVA-1.5-layout
vision-language model (a Llama language model, a small CLIP tower: ``llava_maker.py``),
``gemma3_mm`` Gemma 3's vision-language layout (``gemma3``'s language model, a small SigLIP
tower, pooled: ``gemma3_mm_maker.py``), ``qwen2_5_vl`` Qwen2.5-VL's (``qwen2``'s with 3-D
rotary sections, a small windowed vision transformer: ``qwen2_5_vl_maker.py``),
``qwen3_vl`` Qwen3-VL's (``qwen3``'s with interleaved 3-D rotary sections, a small vision
transformer with DeepStack: ``qwen3_vl_maker.py``), ``qwen3_vl_moe`` the same around
``qwen3_moe``'s, its experts stacked as the releases store them, ``qwen3_5_mm`` Qwen3.5's
(``qwen3_5``'s hybrid language model, the tower without DeepStack).
``granite`` is Granite 3's (Llama with its multipliers), ``granite_hybrid`` Granite
4.0-H's (Mamba-2 layers between rotary-free attention, experts beside a shared MLP) and
``granite_hybrid_dense`` its Micro's (the shared MLP alone; see ``_granite_hybrid_config``),
``nemotron_h`` Nemotron-H's (one block per layer: Mamba-2, attention or a squared-ReLU MLP;
see ``_nemotron_h_config``), ``nemotron_h_moe`` Nemotron 3's (its MLPs ungated experts),
``nemotron_h_latent`` Nemotron 3 Super's (the experts in a latent space half as wide),
``bamba`` Bamba's (Granite 4.0-H-Micro's layers with rotary attention over half a head).
``deepseek_v3`` and ``glm4_moe`` store a random multi-token-prediction layer after their
layers, as the releases do (``_add_mtp_layer``; transformers leaves it unloaded,
``engine.speculative_method: mtp`` drafts with it).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.model_info import (
    DEMO_ARCH,
    DEMO_SIZE,
    MADE_MODEL_INFO,
    MAKER_VERSION,
    made_model_dir,
    made_model_is_current,
)
from common.owned_paths import owner_tag, remove_dead_owners
from engine.models.gemma3_mm_maker import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_IMAGE_TOKENS,
    NEWLINE_RUNS,
    gemma3_mm_config,
    write_gemma3_files,
)
from engine.models.llava_maker import (
    IMAGE_TOKEN,
    LLAVA_CHAT_TEMPLATE,
    llava_config,
    write_preprocessor_config,
)
from engine.models.qwen2_5_vl_maker import (
    QWEN2_5_VL_CHAT_TEMPLATE,
    VISION_TOKENS,
    qwen2_5_vl_config,
    write_qwen2_5_vl_files,
)
from engine.models.qwen3_vl_maker import (
    qwen3_vl_config,
    write_qwen3_vl_files,
    write_released_expert_layout,
)
from engine.models.tokenizer_trainer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    DEEPSEEK_TOOL_TOKENS,
    EOS_TOKEN,
    HARMONY_CHAT_TEMPLATE,
    HARMONY_TOKENS,
    IM_END,
    MISTRAL_TOOL_TOKENS,
    PAD_TOKEN,
    THINK_TOKENS,
    THINKING_CHAT_TEMPLATE,
    train_tokenizer,
)

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5",
         "qwen3_5_moe", "qwen3_next", "gemma3",
         "phi3", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2",
         "llava", "gemma3_mm", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
         "qwen3_5_mm", "granite", "granite_hybrid", "granite_hybrid_dense",
         "nemotron_h", "nemotron_h_moe", "nemotron_h_latent", "bamba")  # fmt: skip
SIZES = ("tiny", "small")
# ChatML for the others.
_CHAT_TEMPLATES = {"qwen3": THINKING_CHAT_TEMPLATE, "qwen3_moe": THINKING_CHAT_TEMPLATE,
                   "qwen3_5": THINKING_CHAT_TEMPLATE, "qwen3_5_moe": THINKING_CHAT_TEMPLATE,
                   "qwen3_next": THINKING_CHAT_TEMPLATE,
                   "gpt_oss": HARMONY_CHAT_TEMPLATE, "llava": LLAVA_CHAT_TEMPLATE,
                   "gemma3_mm": GEMMA3_CHAT_TEMPLATE,
                   "qwen2_5_vl": QWEN2_5_VL_CHAT_TEMPLATE,
                   "qwen3_vl": QWEN2_5_VL_CHAT_TEMPLATE,
                   "qwen3_vl_moe": QWEN2_5_VL_CHAT_TEMPLATE,
                   "qwen3_5_mm": QWEN2_5_VL_CHAT_TEMPLATE}  # fmt: skip
# The vision-language archs' language models.
_TEXT_ARCH = {"llava": "llama", "gemma3_mm": "gemma3", "qwen2_5_vl": "qwen2",
              "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
              "qwen3_5_mm": "qwen3_5"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class SizeSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    # Mixture-of-experts archs: 8 experts, 2 per token, each half the dense MLP's width, so
    # a token's MLP work equals the dense model's (and the experts hold 4x its weights).
    num_experts: int = 8
    num_experts_per_tok: int = 2
    # Mamba-2 archs: the SSM state's width per head (the releases' 128; tiny's 8 keeps a
    # request's states ~9 KV blocks, as Qwen3.5's tiny ones, so the tests' small pools
    # hold several).
    mamba_d_state: int = 128

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size // self.num_experts_per_tok


_SIZES = {
    # ~3.5M parameters (MoE: ~6M): fast enough for CPU tests.
    "tiny": SizeSpec(2048, 256, 4, 4, 2, 64, 512, 4096, mamba_d_state=8),
    # ~150M parameters (MoE: ~460M, ~150M active per token): the benchmark model.
    "small": SizeSpec(8192, 1024, 12, 16, 4, 64, 2816, 4096),
}


def _hf_config(arch: str, spec: SizeSpec, tokenizer_ids: dict[str, int]):
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer_ids["bos"],
        eos_token_id=tokenizer_ids["eos"],
        pad_token_id=tokenizer_ids["pad"],
        initializer_range=1.6 / spec.hidden_size**0.5,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, rope_theta=1e6)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, attention_bias=False)
    linear = dict(
        linear_num_key_heads=spec.num_kv_heads,
        linear_num_value_heads=spec.num_heads,
        linear_key_head_dim=spec.head_dim // 2,
        linear_value_head_dim=spec.head_dim // 2,
    )
    if arch == "qwen3_5":  # every 4th layer full attention, the others gated delta rule
        return transformers.Qwen3_5TextConfig(**common, **linear)
    if arch == "qwen3_5_moe":  # the same, every layer's MLP experts and a shared expert
        return transformers.Qwen3_5MoeTextConfig(
            **common, **linear, num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.expert_intermediate_size,
            shared_expert_intermediate_size=spec.intermediate_size,
        )  # fmt: skip
    if arch == "qwen3_next":  # Qwen3.5-MoE's layers, its in_proj stored as two, interleaved
        return transformers.Qwen3NextConfig(
            **common, **linear, num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.expert_intermediate_size,
            shared_expert_intermediate_size=spec.intermediate_size,
        )  # fmt: skip
    experts = dict(num_experts_per_tok=spec.num_experts_per_tok)
    if arch == "mixtral":  # its experts are intermediate_size wide
        mixtral = {**common, "intermediate_size": spec.expert_intermediate_size}
        return transformers.MixtralConfig(
            **mixtral, **experts, num_local_experts=spec.num_experts, rope_theta=1e6
        )
    # Qwen: the experts are moe_intermediate_size wide; Qwen2-MoE adds a shared expert of
    # the dense width, and renormalizes no top-k weights (Qwen3-MoE's checkpoints do).
    experts.update(num_experts=spec.num_experts,
                   moe_intermediate_size=spec.expert_intermediate_size)  # fmt: skip
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, **experts, shared_expert_intermediate_size=spec.intermediate_size
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, **experts, norm_topk_prob=True, attention_bias=False
        )
    if arch == "gemma3":
        return _gemma3_config(common, spec)
    if arch == "gpt_oss":
        return _gpt_oss_config(common, spec)
    if arch.startswith("deepseek"):
        return _deepseek_config(arch, common, spec)
    if arch == "glm4_moe":
        return _glm4_moe_config(common, spec)
    if arch == "minimax_m2":
        return _minimax_m2_config(common, spec)
    if arch == "granite":
        return transformers.GraniteConfig(**common, **_GRANITE_MULTIPLIERS,
                                          attention_multiplier=spec.head_dim**-1.0)  # fmt: skip
    if arch.startswith("granite_hybrid"):
        return _granite_hybrid_config(arch, common, spec)
    if arch == "bamba":
        return _bamba_config(common, spec)
    if arch.startswith("nemotron_h"):
        return _nemotron_h_config(common, spec, moe=arch != "nemotron_h",
                                  latent=arch == "nemotron_h_latent")  # fmt: skip
    if arch == "phi3":  # Phi-4-mini's shape: tied, 3/4 of each head rotates (default rope)
        return transformers.Phi3Config(
            **common, tie_word_embeddings=True, partial_rotary_factor=0.75, rope_theta=1e4
        )
    raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")


# Granite's multipliers, of the size its releases use (attention_multiplier: 1 / head_dim).
_GRANITE_MULTIPLIERS = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                        "logits_scaling": 4.0}  # fmt: skip


def _granite_hybrid_config(arch: str, common: dict, spec: SizeSpec):
    """Granite 4.0-H's layout: Mamba-2 layers with one attention layer in six (the
    releases: one in ten), attention without rotary positions, the released configs'
    layer names ("mamba", "attention"). ``granite_hybrid`` has experts beside the shared
    MLP (4.0-H-Tiny / -Small; B and C in one group, as released), ``granite_hybrid_dense``
    only the shared MLP (4.0-H-Micro; two B/C groups, to exercise them)."""
    import transformers

    dense = arch == "granite_hybrid_dense"
    heads = 2 * spec.num_heads
    return transformers.GraniteMoeHybridConfig(
        **{**common, "intermediate_size": spec.expert_intermediate_size},
        **_GRANITE_MULTIPLIERS, attention_multiplier=spec.head_dim**-1.0,
        layer_types=["attention" if i % 6 == 1 else "mamba" for i in range(spec.num_layers)],
        position_embedding_type="nope",
        num_local_experts=0 if dense else spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        shared_intermediate_size=spec.intermediate_size,
        mamba_n_heads=heads, mamba_d_head=2 * spec.hidden_size // heads,
        mamba_d_state=spec.mamba_d_state, mamba_n_groups=2 if dense else 1, mamba_expand=2,
    )  # fmt: skip


def _bamba_config(common: dict, spec: SizeSpec):
    """Bamba's layout (``BambaForCausalLM``): Mamba-2 layers (B/C in 2 groups, to exercise
    them; Bamba-9B: 1) with every third layer from the second attention, rotary over half
    of each head (its config class's fixed fraction), a dense gated MLP."""
    import transformers

    heads = 2 * spec.num_heads
    return transformers.BambaConfig(
        **common, attn_layer_indices=[i for i in range(spec.num_layers) if i % 3 == 1],
        mamba_n_heads=heads, mamba_d_head=2 * spec.hidden_size // heads,
        mamba_d_state=spec.mamba_d_state, mamba_n_groups=2, mamba_expand=2,
    )  # fmt: skip


# Nemotron-H's layers as its released configs spell them (``hybrid_override_pattern``).
_NEMOTRON_H_LETTERS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_h_layers(spec: SizeSpec, mlp: str) -> list[str]:
    """Twice the size's layers, each one block: Mamba-2 and MLP (or MoE) layers in turn,
    every third mixing layer attention (tiny: ``M-*-M-M-``; Nemotron-H-8B: 52 layers, 4
    attention; Nemotron 3 Nano: ``MEMEM*E...``)."""
    mixers = ["full_attention" if i % 3 == 1 else "linear_attention"
              for i in range(spec.num_layers)]  # fmt: skip
    return [kind for mixer in mixers for kind in (mixer, mlp)]


def _nemotron_h_config(common: dict, spec: SizeSpec, moe: bool, latent: bool = False):
    """Nemotron-H's layout (``NemotronHForCausalLM``): one block per layer, Mamba-2 with
    B/C in 2 groups (the releases: 8), rotary-free attention, squared-ReLU MLPs; with
    ``moe`` Nemotron 3's experts instead of the MLPs (8 of half the MLP's width, 2 per
    token chosen within the best of 2 groups, scaled by 2.5, a shared expert); with
    ``latent`` Nemotron 3 Super's, the experts running half the hidden width between
    latent projections."""
    import transformers

    kept = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
    heads = 2 * spec.num_heads
    experts = dict(n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                   moe_intermediate_size=spec.expert_intermediate_size,
                   moe_shared_expert_intermediate_size=spec.expert_intermediate_size,
                   n_group=2, topk_group=1, routed_scaling_factor=2.5,
                   moe_latent_size=spec.hidden_size // 2 if latent else None)  # fmt: skip
    return transformers.NemotronHConfig(
        **kept, layers_block_type=_nemotron_h_layers(spec, "moe" if moe else "mlp"),
        layer_norm_epsilon=1e-5, mamba_num_heads=heads,
        mamba_head_dim=2 * spec.hidden_size // heads, ssm_state_size=spec.mamba_d_state,
        n_groups=2, **(experts if moe else {}),
    )  # fmt: skip


def _released_nemotron_h_config(out: Path) -> None:
    """config.json as Nemotron-H's releases write it: the layers as
    ``hybrid_override_pattern``, not transformers 5's ``layers_block_type``."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    types = config.pop("layers_block_type")
    config["hybrid_override_pattern"] = "".join(_NEMOTRON_H_LETTERS[t] for t in types)
    config["num_hidden_layers"] = len(types)
    path.write_text(json.dumps(config, indent=2) + "\n")


def _gemma3_config(common: dict, spec: SizeSpec):
    """Gemma 3 with every part that differs from Llama in play at test lengths: a 64-token
    window on all layers but every other one (Gemma 3: every 6th attends fully), their own
    rotary base, linear rope scaling on the full layers, and an attention scale from a
    ``query_pre_attn_scalar`` that is not head_dim (as in Gemma 3 27B)."""
    import transformers

    return transformers.Gemma3TextConfig(
        **common,
        query_pre_attn_scalar=spec.head_dim * 3 // 2,
        sliding_window=64,
        layer_types=[
            "full_attention" if i % 2 else "sliding_attention" for i in range(spec.num_layers)
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )


def _deepseek_config(arch: str, common: dict, spec: SizeSpec):
    """DeepSeek with every part in play: latent attention whose value width differs from
    the key's nope width, a dense first layer, then 8 routed experts (2 per token) chosen
    within the best 2 of 4 groups, beside shared experts. V3: a q_lora_rank, sigmoid scores
    with a random choice bias (transformers initializes it to zero), renormalized and
    scaled weights, YaRN from a 64-token pretraining context with ``mscale_all_dim`` (the
    softmax scale's correction) as in the release. V2: V2-Lite's single q_proj, softmax
    scores and two shared experts, the default rotary."""
    import transformers

    head_dim = spec.head_dim
    mla = dict(kv_lora_rank=head_dim, qk_rope_head_dim=head_dim // 2,
               qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim * 3 // 4)  # fmt: skip
    experts = dict(n_routed_experts=spec.num_experts, moe_intermediate_size=
                   spec.expert_intermediate_size, num_experts_per_tok=spec.num_experts_per_tok,
                   n_group=4, topk_group=2, first_k_dense_replace=1)  # fmt: skip
    # Latent attention has no head_dim; its configs set as many KV heads as heads.
    common = {k: v for k, v in common.items() if k != "head_dim"}
    common["num_key_value_heads"] = spec.num_heads
    if arch == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **common, **mla, **experts, q_lora_rank=None, n_shared_experts=2,
            topk_method="group_limited_greedy", routed_scaling_factor=2.0,
        )  # fmt: skip
    return transformers.DeepseekV3Config(
        **common, **mla, **experts, q_lora_rank=head_dim * 2, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip


def _glm4_moe_config(common: dict, spec: SizeSpec):
    """GLM-4.5: q/k/v biases (no o_proj bias), q/k RMSNorm, half of each head rotating,
    a dense first layer, then DeepSeek-V3's router (8 experts, 2 per token, within the best
    2 of 4 groups, a random choice bias, scaled weights) beside a shared expert."""
    import transformers

    return transformers.Glm4MoeConfig(
        **common, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
        n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.expert_intermediate_size, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )  # fmt: skip


def _minimax_m2_config(common: dict, spec: SizeSpec):
    """MiniMax-M2: q/k RMSNorm over whole projections, half of each head rotating (its
    configs' ``rotary_dim``), 8 experts of the MoE archs' width, 2 per token, chosen by
    sigmoid scores plus a random choice bias, every layer sparse."""
    import transformers

    experts = {**common, "intermediate_size": spec.expert_intermediate_size}
    return transformers.MiniMaxM2Config(
        **experts, num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    )  # fmt: skip


def _gpt_oss_config(common: dict, spec: SizeSpec):
    """GPT-OSS: attention sinks and biases, a window on every other layer (64 tokens here,
    128 in the release), YaRN from a 64-token pretraining context (4096 in the release, so
    that test prompts reach the stretched range), 8 biased experts of the MoE archs' width
    with the clamped SwiGLU, 2 per token."""
    import transformers

    experts = {**common, "intermediate_size": spec.expert_intermediate_size}
    return transformers.GptOssConfig(
        **experts,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        sliding_window=64,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
        },
    )  # fmt: skip


def make_model(arch: str, size: str, out: str | Path, seed: int = 0) -> Path:
    """Write a checkpoint to ``out`` (created; must not hold one already). Returns ``out``."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    spec = _SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    raw_tokenizer = train_tokenizer(spec.vocab_size)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=_CHAT_TEMPLATES.get(arch, CHAT_TEMPLATE),
        model_max_length=spec.max_position_embeddings,
        # Gemma 3's processor reads its image tokens by these names.
        **({"extra_special_tokens": GEMMA3_IMAGE_TOKENS} if arch == "gemma3_mm" else {}),
    )
    if arch in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"):  # thinking
        tokenizer.add_tokens(THINK_TOKENS)
    if arch == "gpt_oss":  # GPT-OSS writes Harmony: its markers are special tokens
        tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    if arch == "mistral":  # Mistral's tool-call markers, special tokens as in its tokenizers
        tokenizer.add_special_tokens({"additional_special_tokens": MISTRAL_TOOL_TOKENS})
    if arch.startswith("deepseek"):  # DeepSeek's tool-call markers
        tokenizer.add_special_tokens({"additional_special_tokens": DEEPSEEK_TOOL_TOKENS})
    if arch == "llava":  # the image placeholder, a special token as in LLaVA's tokenizers
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    if arch in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_mm"):  # vision tokens
        tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    if arch == "gemma3_mm":  # runs of newlines are one token each, as in Gemma's vocabulary
        tokenizer.add_tokens(NEWLINE_RUNS)
    ids = {
        "bos": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "im_end": tokenizer.convert_tokens_to_ids(IM_END),
    }
    # The model's vocabulary is exactly the tokenizer's, so every sampled id decodes.
    spec = dataclasses.replace(spec, vocab_size=len(tokenizer))
    text_arch = _TEXT_ARCH.get(arch, arch)
    config = _hf_config(text_arch, spec, ids)
    auto_class = transformers.AutoModelForCausalLM
    if arch == "llava":
        config = llava_config(config, tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        auto_class = transformers.AutoModelForImageTextToText
    if arch == "qwen2_5_vl":
        token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        config = qwen2_5_vl_config(config, token_ids)
        auto_class = transformers.AutoModelForImageTextToText
    if arch in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_mm"):
        token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        config = qwen3_vl_config(config, token_ids, arch)
        auto_class = transformers.AutoModelForImageTextToText
    if arch == "gemma3_mm":
        token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_IMAGE_TOKENS.values()}
        config = gemma3_mm_config(config, token_ids)
        auto_class = transformers.AutoModelForImageTextToText
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Non-trivial norm gains, so that norm weights are exercised by parity tests
                # (Gemma stores a gain's offset from 1; its vision tower's LayerNorms do not).
                offset = (text_arch == "gemma3" and "vision_tower" not in name) or (
                    text_arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
                    and ".linear_attn.norm." not in name
                    and "visual." not in name
                )
                param.uniform_(-0.2, 0.2) if offset else param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                # transformers initializes biases to zero, which would leave the bias paths
                # (Qwen2's q/k/v, GPT-OSS's attention, router and experts) untested.
                param.normal_(0.0, 1.6 / spec.hidden_size**0.5)
        if arch.startswith("granite_hybrid") or arch == "bamba":
            for layer in model.model.layers:  # Mamba-2's own init: long memory in some heads
                if getattr(layer, "mamba", None) is not None:
                    _init_mamba2(layer.mamba)
        if arch.startswith("nemotron_h"):
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    _init_mamba2(layer.mixer)
                if layer.block_type == "moe":  # a router that routes, a bias that matters
                    layer.mixer.gate.weight.normal_(0.0, 1.6 / spec.hidden_size**0.5)
                    layer.mixer.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
        if arch == "gpt_oss":  # sinks that take a real share of some heads' attention
            for layer in model.model.layers:
                layer.self_attn.sinks.uniform_(-2.0, 2.0)
        if arch in ("deepseek_v3", "glm4_moe"):  # a choice bias that changes the choice
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
        if arch == "minimax_m2":  # its choice bias sits beside the router
            for layer in model.model.layers:
                layer.mlp.e_score_correction_bias.uniform_(-0.1, 0.1)
        if text_arch == "gemma3":
            # Gemma scales the embeddings by sqrt(hidden_size) and ties the head to them:
            # at the usual init the token's own embedding outweighs every block and the
            # model repeats its last input token, whatever the blocks compute. Smaller
            # embeddings and a larger final gain make the blocks decide the next token.
            language_model = model.model.language_model if arch == "gemma3_mm" else model.model
            language_model.embed_tokens.weight.mul_(0.125)
            language_model.norm.weight.uniform_(6.0, 8.0)
        if arch == "gemma3_mm":  # transformers starts the projection at zero: no image seen
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = [ids["eos"], ids["im_end"]]
    if arch == "gpt_oss":  # a Harmony reply ends with its answer or with a tool call
        harmony_ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
        model.generation_config.eos_token_id = [*harmony_ends, ids["eos"]]
    model.generation_config.bos_token_id = ids["bos"]
    model.generation_config.pad_token_id = ids["pad"]
    model.save_pretrained(out)
    if arch in ("deepseek_v3", "glm4_moe"):
        _add_mtp_layer(out, config, seed)
    if arch.startswith("nemotron_h"):
        _released_nemotron_h_config(out)
    tokenizer.save_pretrained(out)
    if arch == "llava":
        write_preprocessor_config(out)
    if arch == "gemma3_mm":
        write_gemma3_files(out)
    if arch == "qwen2_5_vl":
        write_qwen2_5_vl_files(out)
    if arch in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_mm"):
        write_qwen3_vl_files(out)
    if arch == "qwen3_vl_moe":
        write_released_expert_layout(out)
    info = {"arch": arch, "size": size, "seed": seed, "random_weights": True,
            "maker_version": MAKER_VERSION}  # fmt: skip
    (out / MADE_MODEL_INFO).write_text(json.dumps(info) + "\n")
    return out


def _init_mamba2(mamba) -> None:
    """Mamba-2's initialization (mamba_ssm's, which transformers' random init is not):
    time steps from 0.001 to 0.1 (dt_bias their inverse softplus), decay rates A from 1 to
    16, and D about 1: each head's state then fades over tens to thousands of tokens, so
    tests see states carried across chunks and steps."""
    import torch

    heads = mamba.A_log.shape[0]
    dt = torch.exp(torch.empty(heads).uniform_(torch.log(torch.tensor(1e-3)).item(),
                                               torch.log(torch.tensor(0.1)).item()))  # fmt: skip
    mamba.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    mamba.A_log.copy_(torch.empty(heads).uniform_(1.0, 16.0).log())
    mamba.D.uniform_(0.5, 1.5)


def _add_mtp_layer(out: Path, config, seed: int) -> None:
    """Store an MTP layer as ``model.layers.{num_hidden_layers}`` (DeepSeek-V3's layout):
    a decoder layer named and shaped as the last one as saved (so in the files' own
    format), with fresh random weights initialized as ``make_model`` initializes, the
    MTP inputs' norms and projection (``enorm``, ``hnorm``, ``eh_proj``), the head's norm,
    and copies of the embeddings and LM head (``embed_tokens``, ``shared_head.head``)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"  # the made models are one file
    tensors = load_file(str(path))
    num_layers, hidden = config.num_hidden_layers, config.hidden_size
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    generator = torch.Generator().manual_seed(seed + 1)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    def gains(shape: tuple[int, ...]) -> torch.Tensor:
        return 0.8 + 0.4 * torch.rand(shape, generator=generator)

    layer = {}
    for name, tensor in tensors.items():
        if not name.startswith(last):
            continue
        key, shape = name.removeprefix(last), tuple(tensor.shape)
        if key.endswith("norm.weight"):
            layer[key] = gains(shape)
        elif key.endswith("e_score_correction_bias"):
            layer[key] = torch.rand(shape, generator=generator) * 0.2 - 0.1
        elif key.endswith("bias"):
            layer[key] = normal(shape, 1.6 / hidden**0.5)
        else:
            layer[key] = normal(shape, config.initializer_range)
    layer["enorm.weight"] = gains((hidden,))
    layer["hnorm.weight"] = gains((hidden,))
    layer["eh_proj.weight"] = normal((hidden, 2 * hidden), config.initializer_range)
    layer["shared_head.norm.weight"] = gains((hidden,))
    layer["embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    layer["shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors.update({mtp + key: value.contiguous() for key, value in layer.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


def add_qwen_mtp_layer(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A copy of ``model_dir`` (a made Qwen3.5, one file) with a random MTP layer stored
    as the releases store theirs: ``mtp.layers.0`` a full-attention decoder layer shaped
    as the model's last one, ``mtp.fc`` over the normed embedding and hidden state,
    ``mtp.pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm`` (Qwen3.5's norms
    scale by 1 + weight), and ``mtp_num_hidden_layers: 1`` in its config. transformers
    leaves it unloaded; ``engine.speculative_method: mtp`` drafts with it."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = load_file(str(out / "model.safetensors"))
    types = text["layer_types"]
    last = f"model.layers.{len(types) - 1 - types[::-1].index('full_attention')}."
    hidden = text["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)

    def offsets(shape: tuple[int, ...]) -> torch.Tensor:  # gains 1 + w, w in [-0.2, 0.2)
        return 0.4 * torch.rand(shape, generator=generator) - 0.2

    layer = {
        key.removeprefix(last): offsets(tuple(t.shape)) if key.endswith("norm.weight")
        else torch.randn(tuple(t.shape), generator=generator) * text["initializer_range"]
        for key, t in tensors.items()
        if key.startswith(last)
    }  # fmt: skip
    tensors.update({f"mtp.layers.0.{key}": value for key, value in layer.items()})
    fc = torch.randn((hidden, 2 * hidden), generator=generator) * text["initializer_range"]
    tensors["mtp.fc.weight"] = fc
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = offsets((hidden,))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return out


def ensure_model(arch: str = DEMO_ARCH, size: str = DEMO_SIZE) -> Path:
    """The path of a made model in the cache, making it on first use, and again when it
    was made by an older maker (``common.model_info.MAKER_VERSION``).

    Safe when several processes start at once: one makes it under a file lock, in a
    temporary directory renamed into place, and the others wait and reuse it. The
    temporary directory is named by its maker (``common/owned_paths.py``), and one a
    killed maker on this host left is removed by the next (a cache on a volume that
    several hosts share may have a maker of another host at work beside it).
    """
    target = made_model_dir(arch, size)
    root = target.parent
    if made_model_is_current(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made_model_is_current(target):
            remove_dead_owners(root, f".{target.name}-")
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}-{owner_tag()}-"))
            try:
                make_model(arch, size, tmp)
                if target.exists():  # an older maker's: moved aside, then removed
                    old = tmp.with_name(tmp.name + "-old")
                    target.rename(old)
                    shutil.rmtree(old, ignore_errors=True)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target
