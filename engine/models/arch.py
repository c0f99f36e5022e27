"""What the engine needs to know about a checkpoint's architecture, read from config.json.

Supported: the Llama family (decoder-only, RMSNorm, SwiGLU, rotary positions, GQA): Llama,
Mistral (sliding window), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Phi-3 / Phi-4
(fused projections in the files, partial rotary), and the mixture-of-experts variants,
whose MLP is a set of SwiGLU experts of which a router picks the top k per token: Mixtral,
Qwen2-MoE (plus a gated shared expert) and Qwen3-MoE. Gemma 3 and GPT-OSS are the same
skeleton with other parts (the fields of ``ModelArchConfig`` after ``moe``): Gemma 3's
GeGLU, ``1 + weight`` norms around each block, scaled embeddings, its own attention scale
and a rotary per layer type, its multimodal checkpoints serving text with the vision tower
unloaded; GPT-OSS's attention sinks and biases, biased experts with a clamped SwiGLU and a
top-k-then-softmax router. DeepSeek-V2 and -V3 (and models of their layout: Kimi K2,
Moonlight) replace attention with multi-head latent attention (``MlaConfig``, ``mla.py``)
and route experts their own way (``MoeConfig.deepseek_scoring``); GLM-4.5 is GQA attention
(a partial rotary, maybe q/k norms) with DeepSeek-V3's router; MiniMax-M2 is GQA with q/k
norms over whole projections and that router without groups or shared experts. Hybrid
models put linear-attention layers between attention ones (``linear_attention``): Qwen3.5
and Qwen3-Next the gated delta rule (``LinearAttentionConfig``), Granite 4.0-H Mamba-2
(``Mamba2Config``), with Granite's multipliers (Granite 3 is Llama with them). Rotary
settings are read by ``rope_config.py``; configs that leave keys to transformers' defaults
get those defaults (``common/hf_config.py`` for Gemma 3, GPT-OSS and Granite 4.0-H, here
for DeepSeek).
A LLaVA-layout vision-language checkpoint's language model is any of these (its
``text_config``), with its image side in ``ModelArchConfig.vision``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.hf_config import (
    LINEAR_ATTENTION_DEFAULTS,
    eos_token_ids,
    hybrid_layer_types,
    kv_cache_heads,
    max_context_len,
    mla_latent_dim,
    num_mtp_layers,
    rope_params,
    text_config,
)
from common.vision_spec import (
    MROPE_SECTIONS,
    VisionSpec,
    served_vision_spec,
    vision_architecture,
)
from engine.models.arch_flags import ARCHITECTURES, BY_MODEL_TYPE, ArchFlags
from engine.models.arch_parts import LinearAttentionConfig, Mamba2Config, MlaConfig, MoeConfig
from engine.models.bnb_config import Bnb4Bit, read_bnb_config
from engine.models.checkpoint_files import read_safetensors_header, safetensors_files
from engine.models.errors import ModelLoadError, require
from engine.models.fp8_config import (
    Fp8Weights,
    fp8_kv_cache_declared,
    kv_cache_only,
    read_fp8_config,
    read_quantization_config,
)
from engine.models.int_weights_config import IntWeights, read_int_weights_config
from engine.models.moe_arch import DEEPSEEK_DEFAULTS, moe_config
from engine.models.rope_config import RopeConfig, gemma3_ropes, rope_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    # Per layer: attend to only this many most recent tokens, or None for all.
    sliding_windows: tuple[int | None, ...]
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    max_context_len: int = 0  # the longest context served (hf_config.max_context_len)
    # Gemma 3's departures from Llama (the defaults are Llama's):
    # The MLP's activation: "silu" or "gelu_pytorch_tanh" (gated), "relu2" (Nemotron-H: ungated)
    hidden_act: str = "silu"
    norm_unit_offset: bool = False  # RMSNorm scales by 1 + weight, in float32
    sandwich_norms: bool = False  # each block's output is normed too, before the residual add
    embed_scale: float = 1.0  # token embeddings times this (rounded to the model dtype)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Per layer, where layers differ (Gemma 3's sliding-window layers have their own base);
    # empty: ``rope`` everywhere.
    layer_ropes: tuple[RopeConfig, ...] = ()
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # GPT-OSS: a learned logit per query head in each attention softmax (no value), and
    # RMSNorm multiplying its gain in float32 before casting back.
    attention_sinks: bool = False
    norm_gain_in_float32: bool = False
    # FP8 weights (fp8_config.py), dequantized to the model dtype at load; None: none.
    fp8_weights: Fp8Weights | None = None
    # Whether the checkpoint's KV-cache scales are FP8 ones (its quantization_config says
    # so, whatever its weights; ``kv_scales.py``).
    fp8_kv_scales: bool = False
    # GPTQ's, AWQ's or compressed-tensors' packed integer weights (int_weights_config.py),
    # dequantized at load.
    int_weights: IntWeights | None = None
    # bitsandbytes 4-bit weights (bnb_config.py), dequantized at load.
    bnb_weights: Bnb4Bit | None = None
    # MiniMax-M2: q/k RMSNorm over each token's whole q / k projection (not per head).
    qk_norm_whole: bool = False
    # DeepSeek's latent attention; the KV cache then has one KV head of ``latent_dim / 2``
    # (``num_kv_heads``, ``head_dim``): the K slot holds a token's latent's first half, the
    # V slot its second. None: attention as above.
    mla: MlaConfig | None = None
    # Multi-token-prediction layers stored after the ``num_layers`` the model runs
    # (``num_nextn_predict_layers``); per-layer tuples above cover them too, so MTP layer
    # ``i`` is layer ``num_layers + i`` to them.
    num_mtp_layers: int = 0
    # A vision-language checkpoint's image side (``common/vision_spec.py``); the fields
    # above are its language model's. None: text only.
    vision: VisionSpec | None = None
    # Hybrid models: the layers that are linear attention (Qwen3.5's gated delta rule) or
    # Mamba-2 (Granite 4.0-H's); None: all attend.
    linear_attention: LinearAttentionConfig | Mamba2Config | None = None
    # Qwen3.5's full attention: q_proj also yields a gate per output element
    # (``sigmoid(gate) * attention``, before o_proj).
    attention_output_gate: bool = False
    # Granite's multipliers: token embeddings times ``embedding_multiplier``, each block's
    # output times ``residual_multiplier`` before its residual add, logits divided by
    # ``logits_divisor`` (its logits_scaling), each in the model dtype as transformers.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    # Attention without rotary positions (Granite 4.0-H: its Mamba-2 layers see order).
    nope: bool = False
    # Models whose every layer is one block, normed and added to the residual (Nemotron-H):
    # per layer "mamba", "attention", "mlp" or "moe" (``llama.SingleBlockLayer``). Empty: every
    # layer is attention (or linear attention), then an MLP.
    block_kinds: tuple[str, ...] = ()

    @property
    def mamba2(self) -> Mamba2Config | None:
        """The Mamba-2 layers' config (Granite 4.0-H, Nemotron-H), else None."""
        linear = self.linear_attention
        return linear if isinstance(linear, Mamba2Config) else None

    @property
    def rotary_dim(self) -> int:
        """The head width the rotary tables are built for."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def rope_of(self, layer_idx: int) -> RopeConfig:
        return self.layer_ropes[layer_idx] if self.layer_ropes else self.rope

    def is_linear(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a linear-attention (recurrent) layer."""
        return self.linear_attention is not None and self.linear_attention.layers[layer_idx]

    def is_mlp_only(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is an MLP alone, or experts alone (Nemotron-H's): no
        cache of any kind."""
        return bool(self.block_kinds) and self.block_kinds[layer_idx] in ("mlp", "moe")

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep a paged KV cache (all but linear-attention and MLP-only
        ones), in order: KV cache layer i is model layer ``kv_layers[i]``."""
        return tuple(
            i for i in range(self.num_layers) if not self.is_linear(i) and not self.is_mlp_only(i)
        )

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` runs the experts instead of a dense MLP."""
        return self.moe is not None and self.moe.sparse_layers[layer_idx]

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _dense_width(cfg: dict[str, Any], flags: ArchFlags, path: Path) -> int:
    """The dense MLP's width; 0 for a mixture-of-experts config without one (Qwen3.5-MoE's:
    every layer sparse, which ``moe_config`` checks)."""
    if "intermediate_size" not in cfg and flags.moe:
        return 0
    if flags.granite_hybrid and int(cfg["num_local_experts"] or 0):
        return 0  # every layer's MLP: the experts and the shared MLP (``_granite_moe``)
    return int(require(cfg, "intermediate_size", path))


# transformers' config defaults where a checkpoint's config.json leaves the key out.
_DEFAULT_SLIDING_WINDOW = {"MistralForCausalLM": 4096}
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config, Qwen3Config
# The architectures whose transformers model slides every layer's window by
# ``sliding_window`` when the config has no ``layer_types``; the others ignore the key (a
# Mistral checkpoint exported as Llama keeps "sliding_window": 4096, and was read with
# every layer windowed: other tokens than transformers' from the first).
_WINDOWED = frozenset({"MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"})


def _gemma3_layer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, or as transformers derives them: every ``sliding_window_pattern``-th
    layer (default 6) attends fully, the others through the window."""
    pattern = int(cfg.get("sliding_window_pattern", 6))
    return cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def _sliding_windows(cfg: dict[str, Any], architecture: str, num_layers: int) -> tuple:
    window = cfg.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(architecture))
    if not window:
        return (None,) * num_layers
    layer_types = cfg.get("layer_types")
    if ARCHITECTURES[architecture].gemma3:
        layer_types = _gemma3_layer_types(cfg, num_layers)
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if architecture == "Qwen3MoeForCausalLM":  # every layer, with use_sliding_window
        return (window if cfg.get("use_sliding_window", False) else None,) * num_layers
    if architecture == "Qwen2MoeForCausalLM":  # Qwen2MoeConfig's rule: every other layer
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        last = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        return tuple(window if (i + 1) % 2 and i < last else None for i in range(num_layers))
    if architecture.startswith("Qwen"):
        # Qwen2/3 before layer_types: sliding only with use_sliding_window, and only from
        # layer max_window_layers on.
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        first = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        return tuple(window if i >= first else None for i in range(num_layers))
    return ((window if architecture in _WINDOWED else None),) * num_layers


def _deepseek_attention(cfg: dict[str, Any], architecture: str, rope: RopeConfig,
                        path: Path) -> dict[str, Any]:  # fmt: skip
    """ModelArchConfig's fields for latent attention: ``mla``, the cache's one KV head of
    half a latent (``hf_config.kv_cache_heads``), and the softmax scale: over the
    ``qk_nope_head_dim + qk_rope_head_dim`` dims a head's query and key have, times
    YaRN's ``mscale_all_dim`` correction squared (as transformers)."""
    cfg = {**DEEPSEEK_DEFAULTS[architecture], **cfg}
    latent_dim = mla_latent_dim(cfg)
    if latent_dim is None or latent_dim % 2:
        raise ModelLoadError(f"{path}: kv_lora_rank + qk_rope_head_dim must be a positive "
                             f"even number, got {latent_dim}")  # fmt: skip
    q_lora_rank = cfg.get("q_lora_rank")
    mla = MlaConfig(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
        v_head_dim=int(cfg.get("v_head_dim", 128)),
        # V2 rotates pairs (as complex numbers) always; V3 as rope_interleave says.
        rope_interleaved=architecture == "DeepseekV2ForCausalLM"
        or bool(cfg.get("rope_interleave", True)),
    )
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    params = rope_params(cfg)
    if rope.rope_type != "default" and params.get("mscale_all_dim"):
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(rope.factor) + 1.0
        scale *= (mscale if rope.factor > 1 else 1.0) ** 2
    num_kv_heads, head_dim = kv_cache_heads(cfg)
    return {"mla": mla, "attention_scale": scale, "num_kv_heads": num_kv_heads,
            "head_dim": head_dim}  # fmt: skip


def read_arch_config(model_dir: str | Path) -> ModelArchConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if not path.exists():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face checkpoint")
    return arch_from_config(json.loads(path.read_text()), model_dir)


def arch_from_config(raw: dict[str, Any], model_dir: Path) -> ModelArchConfig:
    """``read_arch_config`` of ``raw``, a config.json's contents; ``model_dir`` holds the
    checkpoint's other files (its generation config, ModelOpt's quantization file) and
    names it in messages."""
    path = model_dir / "config.json"
    # transformers falls back to model_type when a config names no architectures.
    architectures = raw.get("architectures") or [BY_MODEL_TYPE.get(raw.get("model_type"), "")]
    cfg = text_config(raw)
    vision = served_vision_spec(raw, path)
    if vision is not None and not _has_vision_weights(model_dir):
        logger.warning("%s holds no vision tower weights; serving its language model for text "
                       "only", model_dir)  # fmt: skip
        vision = None
    if vision_architecture(raw) and not any(a in ARCHITECTURES for a in architectures):
        # LLaVA's: the language model is the text_config's (Gemma 3's is named as such).
        architectures = [BY_MODEL_TYPE.get(cfg.get("model_type"), str(cfg.get("model_type")))]
    architecture = next((a for a in architectures if a in ARCHITECTURES), None)
    if architecture is None:
        raise ModelLoadError(
            f"{path}: architecture {architectures or cfg.get('model_type')!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    flags = ARCHITECTURES[architecture]
    num_layers = int(require(cfg, "num_hidden_layers", path))
    mtp_layers = num_mtp_layers(cfg)  # stored after num_layers; per-layer tuples cover them
    hidden_size = int(require(cfg, "hidden_size", path))
    num_q_heads = int(require(cfg, "num_attention_heads", path))
    head_dim = cfg.get("head_dim") or hidden_size // num_q_heads
    # Llama and Qwen3 put attention_bias on q/k/v/o; Qwen2 always biases q/k/v only;
    # Mistral and Mixtral never have attention biases.
    config_bias = bool(cfg.get("attention_bias", False)) and architecture not in (
        "MistralForCausalLM",
        "MixtralForCausalLM",
    )
    qkv_bias = flags.qkv_bias or config_bias
    if architecture == "Qwen2MoeForCausalLM":  # its q/k/v bias is a key (default on)
        qkv_bias = bool(cfg.get("qkv_bias", True))
    o_bias = config_bias and not flags.qkv_bias and not flags.glm4_moe
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias=true is not supported")
    if not flags.gemma3:
        activation = cfg.get("hidden_act", "silu")
        if activation not in ("silu", "swish") and not flags.nemotron_h:
            raise ModelLoadError(f"{path}: hidden_act {activation!r} is not supported (only silu)")
    fp8_weights = None
    quantization = read_quantization_config(raw, cfg, model_dir)
    int_weights = read_int_weights_config(quantization, path) if quantization else None
    bnb_weights = read_bnb_config(quantization, path) if quantization else None
    # GPT-OSS's MXFP4 experts are dequantized at load (gpt_oss_weights.py).
    mxfp4 = flags.gpt_oss and quantization and quantization.get("quant_method") == "mxfp4"
    weights_quantized = quantization and not kv_cache_only(quantization)
    if weights_quantized and int_weights is None and bnb_weights is None and not mxfp4:
        fp8_weights = read_fp8_config(quantization, path)
    # Whether its KV-cache scales are FP8 ones (``kv_scales.py``), whatever its weights.
    fp8_kv_scales = (fp8_weights.fp8_kv_scales if fp8_weights is not None
                     else bool(quantization) and fp8_kv_cache_declared(quantization))  # fmt: skip
    gemma3 = _gemma3_fields(cfg, num_layers, hidden_size, path) if flags.gemma3 else {}
    if flags.minimax_m2 and cfg.get("rotary_dim") and "partial_rotary_factor" not in cfg:
        # MiniMax-M2's released configs give the rotary width as rotary_dim.
        cfg = {**cfg, "partial_rotary_factor": int(cfg["rotary_dim"]) / int(head_dim)}
    partial = flags.glm4_moe or flags.minimax_m2 or flags.qwen3_5 or flags.bamba
    if flags.qwen3_5 and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": 0.25}  # Qwen3_5TextConfig's default
    if flags.glm4_moe and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": 0.5}  # Glm4MoeConfig's default (it was 1)
    rope = gemma3.pop("rope") if gemma3 else rope_config(cfg, path, flags.phi3_rope, partial)
    if vision is not None and vision.mrope:
        rope = _mrope(rope, int(head_dim), vision, path)
    attention = {"num_kv_heads": int(cfg.get("num_key_value_heads") or num_q_heads),
                 "head_dim": int(head_dim)}  # fmt: skip
    if flags.latent_attention:
        attention = _deepseek_attention(cfg, architecture, rope, path)
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=int(require(cfg, "vocab_size", path)),
        hidden_size=hidden_size,
        intermediate_size=_dense_width(cfg, flags, path),
        num_layers=num_layers,
        num_q_heads=num_q_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=flags.qk_norm or (flags.glm4_moe and bool(cfg.get("use_qk_norm", False))),
        sliding_windows=_sliding_windows(cfg, architecture, num_layers + mtp_layers),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        eos_token_ids=eos_token_ids(cfg, model_dir),
        bos_token_id=cfg.get("bos_token_id"),
        moe=moe_config(cfg, architecture, num_layers + mtp_layers, path),
        max_context_len=max_context_len(cfg),
        attention_sinks=flags.gpt_oss,
        norm_gain_in_float32=flags.gpt_oss or flags.nemotron_h,
        fp8_weights=fp8_weights,
        fp8_kv_scales=fp8_kv_scales,
        int_weights=int_weights,
        bnb_weights=bnb_weights,
        qk_norm_whole=flags.minimax_m2,
        num_mtp_layers=mtp_layers,
        vision=vision,
        **attention,
        **gemma3,
        **(_qwen3_5_fields(cfg, num_layers, mtp_layers, path) if flags.qwen3_5 else {}),
        **(_granite_fields(cfg, flags.granite_hybrid, num_layers, path) if flags.granite else {}),
        **(_nemotron_h_fields(cfg, num_layers, path) if flags.nemotron_h else {}),
    )


# Nemotron-H's layer types (``text_config``'s) as ``ModelArchConfig.block_kinds``.
_NEMOTRON_H_BLOCKS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp",
                      "moe": "moe"}  # fmt: skip


def _nemotron_h_fields(cfg: dict[str, Any], num_layers: int, path: Path) -> dict[str, Any]:
    """ModelArchConfig's Nemotron-H fields (``text_config`` read its names and defaults):
    one block per layer, Mamba-2 layers, rotary-free attention, squared-ReLU MLPs (or
    Nemotron 3's experts: ``_nemotron_h_moe``), norm gains in float32."""
    types = cfg["layer_types"]
    activation = cfg.get("mlp_hidden_act", "relu2")
    if activation != "relu2":
        raise ModelLoadError(f"{path}: mlp_hidden_act {activation!r} is not supported (relu2)")
    unknown = set(types) - set(_NEMOTRON_H_BLOCKS)
    if unknown:
        raise ModelLoadError(f"{path}: unknown layer types {sorted(unknown)}")
    return {
        "linear_attention": _mamba2_config(cfg, num_layers, path),
        "block_kinds": tuple(_NEMOTRON_H_BLOCKS[t] for t in types),
        "nope": True,
        "hidden_act": "relu2",
    }


def _granite_fields(
    cfg: dict[str, Any], hybrid: bool, num_layers: int, path: Path
) -> dict[str, Any]:
    """ModelArchConfig's Granite fields (GraniteConfig's defaults: multipliers of 1), and
    Granite 4.0-H's Mamba-2 layers and rotary-free attention (unless its
    position_embedding_type is "rope")."""
    fields: dict[str, Any] = dict(
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_divisor=float(cfg.get("logits_scaling", 1.0)),
        attention_scale=float(cfg.get("attention_multiplier", 1.0)),
    )
    if hybrid:
        if "mlp" in cfg["layer_types"]:
            raise ModelLoadError(f"{path}: layer_types must name mamba or attention layers")
        fields["nope"] = cfg.get("position_embedding_type") != "rope"
        fields["linear_attention"] = _mamba2_config(cfg, num_layers, path)
    return fields


def _mamba2_config(cfg: dict[str, Any], num_layers: int, path: Path) -> Mamba2Config:
    """Granite 4.0-H's or Nemotron-H's Mamba-2 layers (``text_config`` filled their
    defaults in, under Granite's key names)."""
    types = cfg["layer_types"]
    if len(types) < num_layers or set(types) - {"linear_attention", "full_attention", "mlp",
                                                 "moe"}:  # fmt: skip
        raise ModelLoadError(f"{path}: layer_types must name mamba or attention for each of "
                             f"the {num_layers} layers")  # fmt: skip
    heads, groups = int(cfg["mamba_n_heads"]), int(cfg["mamba_n_groups"])
    mamba = Mamba2Config(
        num_heads=heads,
        head_dim=int(cfg["mamba_d_head"]),
        state_size=int(cfg["mamba_d_state"]),
        num_groups=groups,
        conv_kernel=int(cfg["mamba_d_conv"]),
        layers=tuple(t == "linear_attention" for t in types[:num_layers]),
        norm_group_size=int(cfg["mamba_d_head"]) * heads // max(groups, 1),
        conv_bias=bool(cfg["mamba_conv_bias"]),
        proj_bias=bool(cfg["mamba_proj_bias"]),
        **_time_step_limit(cfg.get("time_step_limit"), path),
    )
    expand = cfg.get("mamba_expand")  # (Granite's; Nemotron-H's width is heads x head_dim)
    if expand is not None and mamba.intermediate_size != int(expand) * int(cfg["hidden_size"]):
        raise ModelLoadError(f"{path}: mamba_n_heads x mamba_d_head must be mamba_expand x "
                             "hidden_size")  # fmt: skip
    if groups < 1 or heads % groups:
        raise ModelLoadError(f"{path}: mamba_n_heads={heads} in mamba_n_groups={groups}")
    if "full_attention" not in types[:num_layers]:
        raise ModelLoadError(f"{path}: no attention layer (a KV cache needs one)")
    return mamba


def _time_step_limit(limit: Any, path: Path) -> dict[str, float]:
    """``Mamba2Config``'s ``dt_min`` / ``dt_max`` of a config's ``time_step_limit``: two
    numbers, where transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if limit is None:
        return {}
    values = [v.get("__float__") if isinstance(v, dict) else v for v in limit]
    try:
        low, high = (float(v) for v in values)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{path}: time_step_limit {limit!r} is not two numbers") from None
    return {"dt_min": low, "dt_max": high}


def _qwen3_5_fields(
    cfg: dict[str, Any], num_layers: int, mtp_layers: int, path: Path
) -> dict[str, Any]:
    """ModelArchConfig's Qwen3.5 fields (Qwen3_5TextConfig's defaults where the config
    leaves keys out: every 4th layer full attention; its MTP layers, after the model's,
    are full attention)."""
    types = hybrid_layer_types(cfg)
    if len(types) < num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelLoadError(
            f"{path}: layer_types must name linear_attention or full_attention for each of "
            f"the {num_layers} layers"
        )
    dims = {**LINEAR_ATTENTION_DEFAULTS, **cfg}
    linear = LinearAttentionConfig(
        num_key_heads=int(dims["linear_num_key_heads"]),
        num_value_heads=int(dims["linear_num_value_heads"]),
        key_head_dim=int(dims["linear_key_head_dim"]),
        value_head_dim=int(dims["linear_value_head_dim"]),
        conv_kernel=int(dims["linear_conv_kernel_dim"]),
        layers=tuple(t == "linear_attention" for t in types[:num_layers]) + (False,) * mtp_layers,
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"{path}: linear_num_value_heads {linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads {linear.num_key_heads}"
        )
    if all(linear.layers[:num_layers]):
        raise ModelLoadError(f"{path}: no full_attention layer (a KV cache needs one)")
    return {"linear_attention": linear, "attention_output_gate": True, "norm_unit_offset": True}


_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh GELU


def _mrope(rope: RopeConfig, head_dim: int, vision: VisionSpec, path: Path) -> RopeConfig:
    """The rotary with the vision architecture's M-RoPE sections (transformers' default
    where the config names none: ``MROPE_SECTIONS``), which must cover the rotary's
    frequency pairs, interleaved as it says."""
    interleaved = vision.mrope_interleaved
    section = rope.mrope_section or MROPE_SECTIONS[vision.architecture]
    if len(section) != 3 or sum(section) != rope.rotary_dim(head_dim) // 2:
        raise ModelLoadError(
            f"{path}: mrope_section {list(section)} must be 3 sections of the rotary's "
            f"{rope.rotary_dim(head_dim) // 2} frequency pairs"
        )
    return dataclasses.replace(rope, mrope_section=tuple(section), mrope_interleaved=interleaved)


def _gemma3_fields(
    cfg: dict[str, Any], num_layers: int, hidden_size: int, path: Path
) -> dict[str, Any]:
    """ModelArchConfig's Gemma 3 fields (``text_config`` filled transformers' defaults in)."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if activation not in _GELU_TANH:
        raise ModelLoadError(
            f"{path}: hidden_activation {activation!r} is not supported for Gemma 3 "
            f"(only {_GELU_TANH[0]})"
        )
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{path}: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{path}: use_bidirectional_attention=true (an embedding model) is not supported"
        )
    full, sliding = gemma3_ropes(cfg, path)
    layer_types = _gemma3_layer_types(cfg, num_layers)
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"{path}: {len(layer_types)} layer_types for {num_layers} layers")
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        rope=full,
        hidden_act=_GELU_TANH[0],
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=hidden_size**0.5,
        attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        layer_ropes=tuple(sliding if t == "sliding_attention" else full for t in layer_types),
        final_logit_softcap=float(softcap) if softcap is not None else None,
    )


# Where vision-language checkpoints keep their image side (transformers 4's names, then 5's).
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "visual.", "model.visual.")


def _has_vision_weights(model_dir: Path) -> bool:
    """Whether the checkpoint's files hold a vision tower: a text-only export of a
    vision-language model keeps its config but not the tower. True when it has no weight
    files to look at (the loader says what is missing)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text()).get("weight_map", {})
    else:
        try:
            files = safetensors_files(model_dir)
        except ModelLoadError:
            return True
        names = {}
        for path in files:
            with open(path, "rb") as f:
                names.update(json.loads(read_safetensors_header(f)))
    return any(name.startswith(_VISION_PREFIXES) for name in names)
