"""A checkpoint's language-model config: config.json as transformers would read it.

Two things make config.json not simply "the model's settings":

- Multimodal checkpoints served for text (Gemma 3 from 4B up, ``Gemma3ForConditionalGeneration``)
  nest the language model's settings under ``text_config``; token ids, dtype and
  ``tie_word_embeddings`` may sit at the top level.
- Gemma 3's configs on the Hub leave most keys out (gemma-3-4b-it's ``text_config`` names
  six), relying on transformers' ``Gemma3TextConfig`` defaults; a GPT-OSS config may rely
  on ``GptOssConfig``'s. Those are filled in here, so that the engine, the KV budget check
  and the router all read the same numbers.

``max_context_len`` is the context a config serves (YaRN stretches it), and
``kv_cache_heads`` the KV cache's heads and head width (DeepSeek's latent attention caches
one shared vector per token), read by the same three.

Plain json, no torch: the router and ``pdserve config check`` read it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' Gemma3TextConfig defaults (5.x), for the keys a Gemma 3 config may leave out.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
GEMMA3_TEXT_MODEL_TYPES = ("gemma3_text", "gemma3")
# transformers' literal head_dim defaults: a config saved with its defaults left out (as
# save_pretrained writes one) has no head_dim, and hidden_size // num_attention_heads is
# not it (Qwen3-0.6B: 1024 // 16 = 64, its heads 128 wide).
HEAD_DIM_DEFAULTS: dict[str, int] = {
    "qwen3": 128, "qwen3_vl": 128, "qwen3_vl_text": 128, "minimax_m2": 128, "qwen3_next": 256,
    "qwen3_5": 256, "qwen3_5_text": 256, "qwen3_5_moe": 256, "qwen3_5_moe_text": 256,
}  # fmt: skip
# transformers' GptOssConfig defaults (5.x); layer_types and the rope: ``_gpt_oss``.
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "vocab_size": 201_088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "sliding_window": 128,
    "rope_theta": 150_000.0,
    "swiglu_limit": 7.0,
}
# GptOssConfig's rope when config.json names none: YaRN from 4k by 32x, untruncated.
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# transformers' GraniteMoeHybridConfig defaults (5.x), for the keys a Granite 4.0-H config
# may leave out.
GRANITE_HYBRID_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 11008,
    "shared_intermediate_size": 1024,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "mamba_n_heads": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_head": "auto",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}
# Layer type names of configs written before transformers 5 (``remap_legacy_layer_types``).
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# transformers' NemotronHConfig defaults (5.x) for the keys a Nemotron-H config may leave
# out, under the names Granite 4.0-H's use (``_nemotron_h``): its own names first.
_NEMOTRON_H_KEYS = {  # Granite's key: (Nemotron-H's keys, default)
    "mamba_n_heads": (("mamba_num_heads",), 128),
    "mamba_d_head": (("mamba_head_dim",), 64),
    "mamba_d_state": (("ssm_state_size",), 128),
    "mamba_n_groups": (("n_groups", "mamba_n_groups"), 8),
    "mamba_d_conv": (("conv_kernel", "mamba_d_conv"), 4),
    "mamba_conv_bias": (("use_conv_bias", "mamba_conv_bias"), True),
    "mamba_proj_bias": (("use_bias",), False),
    "rms_norm_eps": (("layer_norm_epsilon",), 1e-5),
    "intermediate_size": (("intermediate_size",), 21504),
    "num_attention_heads": (("num_attention_heads",), 32),
    "num_key_value_heads": (("num_key_value_heads",), 8),
    "head_dim": (("head_dim",), 128),
}
# ``hybrid_override_pattern``'s letters: Mamba-2, attention, MLP, mixture of experts.
_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Keys of a multimodal config's top level that apply to its language model.
_TOP_LEVEL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                   "torch_dtype", "dtype")  # fmt: skip


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings of a parsed config.json (see the module docstring)."""
    nested = cfg.get("text_config")
    if isinstance(nested, dict):
        top = {key: cfg[key] for key in _TOP_LEVEL_KEYS if cfg.get(key) is not None}
        # The text_config's own values win, except for what transformers takes from the top.
        merged = {**top, **nested}
        # The top-level model owns the head: its setting ties it. LlavaConfig and
        # Qwen2.5-VL's tie where either level says so (a tied Qwen2-0.5B inside LLaVA
        # stores no head, under a top-level false); without a top-level key Gemma3Config
        # ties (whatever its text_config says), the others as their text_config says.
        model_type = cfg.get("model_type")
        nested_tie = bool(nested.get("tie_word_embeddings"))
        if model_type in ("llava", "qwen2_5_vl"):
            tied = bool(top.get("tie_word_embeddings")) or nested_tie
        else:
            tied = top.get("tie_word_embeddings", model_type == "gemma3" or nested_tie)
        merged["tie_word_embeddings"] = tied
        merged.setdefault("model_type", "gemma3_text" if model_type == "gemma3" else "")
        cfg = merged
    if cfg.get("model_type") in GEMMA3_TEXT_MODEL_TYPES:
        cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}  # absent keys only: an explicit null stays
    head_dim = HEAD_DIM_DEFAULTS.get(cfg.get("model_type", ""))
    if head_dim is not None and "head_dim" not in cfg:
        cfg = {**cfg, "head_dim": head_dim}
    if cfg.get("model_type") == "gpt_oss":
        cfg = _gpt_oss(cfg)
    if cfg.get("model_type") == "granitemoehybrid":
        cfg = _granite_hybrid(cfg)
    if cfg.get("model_type") == "nemotron_h":
        cfg = _nemotron_h(cfg)
    if cfg.get("model_type") == "bamba":
        cfg = _granite_hybrid(_bamba(cfg))
    return cfg


# transformers' BambaConfig defaults (5.x) for the keys a Bamba config may leave out.
BAMBA_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "mamba_n_heads": 128, "mamba_n_groups": 1,
    "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "time_step_limit": [0.0, float("inf")],
}  # fmt: skip


def _bamba(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Bamba config (IBM's ``BambaForCausalLM``: Granite 4.0-H's Mamba-2 layers and dense
    MLP, with rotary attention over half of each head and no multipliers) under Granite
    4.0-H's keys: its attention layers (``attn_layer_indices``) as ``layer_types``, no
    experts, the MLP as the shared one, rotary positions, the usual softmax scale, and
    the rotary fraction its config class fixes at 0.5."""
    cfg = {**BAMBA_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    attention = set(cfg.get("attn_layer_indices") or ())
    cfg["layer_types"] = ["full_attention" if i in attention else "linear_attention"
                          for i in range(int(cfg["num_hidden_layers"]))]  # fmt: skip
    cfg["num_local_experts"] = 0
    cfg["shared_intermediate_size"] = int(cfg["intermediate_size"])
    cfg["position_embedding_type"] = "rope"
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    cfg["attention_multiplier"] = head_dim**-0.5
    cfg.setdefault("partial_rotary_factor", 0.5)
    return cfg


def _nemotron_h(cfg: dict[str, Any]) -> dict[str, Any]:
    """NemotronHConfig's keys and defaults under Granite 4.0-H's names (the Mamba-2 layers'
    dims, ``rms_norm_eps``), its layers as ``layer_types`` ("linear_attention",
    "full_attention", "mlp", "moe": from ``layers_block_type``, ``layer_types`` or the
    released ``hybrid_override_pattern``), ``num_hidden_layers`` their count, and
    ``time_step_limit`` what its Mamba-2 layers clamp time steps to: ``[time_step_min,
    inf]`` (transformers' ``NemotronHMamba2Mixer``, whatever the config's own
    time_step_limit)."""
    cfg = dict(cfg)
    for key, (names, default) in _NEMOTRON_H_KEYS.items():
        cfg[key] = next((cfg[name] for name in names if cfg.get(name) is not None), default)
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types and cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        types = [_NEMOTRON_H_PATTERN.get(letter, letter) for letter in pattern]
    types = types or ["linear_attention", "moe", "full_attention", "mlp"]
    cfg["layer_types"] = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
    cfg["num_hidden_layers"] = len(types)
    if "moe" in cfg["layer_types"]:  # Nemotron 3: NemotronHConfig's defaults for experts
        cfg.setdefault("n_routed_experts", 8)
        cfg.setdefault("num_experts_per_tok", 2)
        cfg.setdefault("moe_intermediate_size", 7688)
        cfg.setdefault("moe_shared_expert_intermediate_size", 7688)
        cfg["shared_expert_intermediate_size"] = cfg["moe_shared_expert_intermediate_size"]
    else:  # (its config class's expert keys describe no layer)
        cfg.pop("n_routed_experts", None)
    time_step_min = cfg.get("time_step_min", cfg.get("mamba_dt_min", 0.001))
    cfg["time_step_limit"] = [float(time_step_min), float("inf")]
    return cfg


def _granite_hybrid(cfg: dict[str, Any]) -> dict[str, Any]:
    """GraniteMoeHybridConfig's defaults and derived keys (``mamba_d_head`` "auto": the
    Mamba-2 width over its heads; no ``layer_types``: every layer Mamba-2; the released
    configs' "mamba" / "attention" read as "linear_attention" / "full_attention"), and its
    MLP widths under the keys other MoE configs use: with experts (``num_local_experts``
    > 0, ``intermediate_size`` wide) the shared MLP is ``shared_expert_intermediate_size``
    wide; without, it is the dense ``intermediate_size``."""
    cfg = {**GRANITE_HYBRID_DEFAULTS, **cfg}
    if cfg["mamba_d_head"] == "auto":
        width = int(cfg["mamba_expand"]) * int(cfg["hidden_size"])
        cfg["mamba_d_head"] = width // int(cfg["mamba_n_heads"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    types = types or ["linear_attention"] * int(cfg["num_hidden_layers"])
    cfg["layer_types"] = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
    shared = int(cfg["shared_intermediate_size"])
    if int(cfg["num_local_experts"] or 0):
        cfg["moe_intermediate_size"] = int(cfg["intermediate_size"])
        cfg["shared_expert_intermediate_size"] = shared
    else:
        cfg["intermediate_size"] = shared
    return cfg


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """GptOssConfig's defaults: a window on every other layer from the first, its YaRN."""
    cfg = {**GPT_OSS_DEFAULTS, **cfg}
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention"
            for i in range(int(cfg["num_hidden_layers"]))
        ]
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = dict(GPT_OSS_ROPE)
    return cfg


def read_text_config(model_dir: str | Path) -> dict[str, Any]:
    """``text_config`` of ``model_dir/config.json``; raises what reading and parsing it raise
    (``FileNotFoundError``, ``json.JSONDecodeError``)."""
    return text_config(json.loads((Path(model_dir) / "config.json").read_text()))


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config's rotary parameters as transformers 5 reads them: a legacy ``rope_scaling``
    (transformers 4's configs, or a block a model card says to add) replaces
    ``rope_parameters`` whole, keeping only its ``rope_theta``. They were merged key by
    key, ``rope_parameters`` first: a YaRN block added to a transformers-5 config came out
    as the default rotary with a factor, other tokens and no longer context (an audit)."""
    scaling = cfg.get("rope_scaling")
    parameters = cfg.get("rope_parameters")
    parameters = parameters if isinstance(parameters, dict) else {}
    if not isinstance(scaling, dict) or not scaling:
        return dict(parameters)
    theta = parameters.get("rope_theta")
    return {**({} if theta is None else {"rope_theta": theta}), **scaling}


def max_context_len(cfg: dict[str, Any]) -> int:
    """The longest context a (``text_config``) config serves, as vLLM derives it:
    ``max_position_embeddings``, or with YaRN the pretraining context times the factor, if
    longer (Qwen2.5 and Qwen3 keep ``max_position_embeddings`` at the pretraining length
    and enable 4x more with a YaRN ``rope_scaling``), or with linear scaling that times
    the factor (vicuna-7b-v1.5-16k: 4,096 x 4; it was held at 4,096, and no setting could
    raise it; an audit). Gemma 3's linear factor is already in its
    ``max_position_embeddings``, as llama3's is."""
    limit = int(cfg.get("max_position_embeddings", 2048))
    params = rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type"))
    factor = float(params.get("factor") or 0.0)
    if rope_type == "yarn" and factor:
        original = (cfg.get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings") or limit)  # fmt: skip
        limit = max(limit, int(original * factor))
    elif (
        rope_type == "linear"
        and factor > 1
        and cfg.get("model_type") not in GEMMA3_TEXT_MODEL_TYPES
    ):
        limit = int(limit * factor)
    return limit


def eos_token_ids(cfg: dict[str, Any], model_dir: str | Path) -> tuple[int, ...]:
    """The ids that end a sequence, as vLLM stops: the tokenizer's EOS, then
    generation_config.json's ``eos_token_id`` (one or a list) where it names any, else the
    (``text_config``) config's. The engine stops on them; the router keeps their text out
    of the output. Without the tokenizer's, a ChatML fine-tune (EOS ``<|im_end|>`` in its
    tokenizer_config, ``</s>`` in config.json, no generation_config) never stopped."""
    from common.tokenizer import tokenizer_eos_token_id

    eos = cfg.get("eos_token_id")
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        eos = gen_eos if gen_eos is not None else eos
    listed = [] if eos is None else [int(i) for i in eos] if isinstance(eos, list) else [int(eos)]
    tokenizer_eos = tokenizer_eos_token_id(model_dir)
    found = ([tokenizer_eos] if tokenizer_eos is not None else []) + listed
    return tuple(dict.fromkeys(found))


# Checkpoints that store multi-token-prediction layers after ``num_hidden_layers`` (V3's
# ``model.layers.61``, GLM-4.5's ``model.layers.46``), by architecture and model type: left
# unloaded, as transformers does, unless the engine drafts with them
# (``engine.speculative_method: mtp``, ``engine/models/mtp.py``).
MTP_LAYER_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
_MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe")
# Qwen3.5's (and Qwen3-Next's) layout: ``mtp.fc``, ``mtp.layers.{i}``, ``mtp.norm``, ...
# beside the model, counted by ``mtp_num_hidden_layers``.
QWEN_MTP_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                          "Qwen3_5ForConditionalGeneration",
                          "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM")  # fmt: skip
_QWEN_MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                         "qwen3_next")  # fmt: skip


def num_mtp_layers(cfg: dict[str, Any]) -> int:
    """The MTP layers a checkpoint of this config stores (``num_nextn_predict_layers``;
    Qwen3.5's ``mtp_num_hidden_layers``); 0 for architectures that have none."""
    architectures = set(cfg.get("architectures") or [])
    model_type = cfg.get("model_type")
    if architectures & set(QWEN_MTP_ARCHITECTURES) or model_type in _QWEN_MTP_MODEL_TYPES:
        return int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    if not (
        architectures & set(MTP_LAYER_ARCHITECTURES)
        or (not architectures and model_type in _MTP_MODEL_TYPES)
    ):
        return 0
    return int(cfg.get("num_nextn_predict_layers") or 0)


def mla_latent_dim(cfg: dict[str, Any]) -> int | None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2: configs with a
    ``kv_lora_rank``): the elements a token caches per layer, one vector of
    ``kv_lora_rank + qk_rope_head_dim`` that every head reads; None for other attention."""
    rank = cfg.get("kv_lora_rank")
    if not rank:
        return None
    return int(rank) + int(cfg.get("qk_rope_head_dim", 64))


def kv_cache_heads(cfg: dict[str, Any]) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of the KV cache's ``[num_blocks, 2, block_size,
    num_kv_heads, head_dim]`` per layer. Latent attention stores its vector as one KV head
    split in two: the first half in the K slot, the second in the V slot (DESIGN_NOTES,
    "Latent attention"), so every cache, connector and tier handles it as it is."""
    latent_dim = mla_latent_dim(cfg)
    if latent_dim is not None:
        return 1, latent_dim // 2
    num_heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
    return int(cfg.get("num_key_value_heads") or num_heads), int(head_dim)


# Hybrid models' language models, whose layer_types mix linear and full attention
# (``Qwen3_5TextConfig``: every ``full_attention_interval``-th layer full, default 4);
# Granite 4.0-H's and Nemotron-H's linear layers are Mamba-2 (``MAMBA2_MODEL_TYPES``).
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe",
                      "qwen3_next", "granitemoehybrid", "nemotron_h", "bamba")  # fmt: skip
MAMBA2_MODEL_TYPES = ("granitemoehybrid", "nemotron_h", "bamba")
# Qwen3_5TextConfig's defaults for its linear-attention keys.
LINEAR_ATTENTION_DEFAULTS = {
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}  # fmt: skip


def layer_types(cfg: dict[str, Any]) -> list[str] | None:
    """Each layer's ``linear_attention`` or ``full_attention`` (or Nemotron-H's ``mlp``,
    a layer that is an MLP alone) for a hybrid model's (text) config; None for any other
    model."""
    types = cfg.get("layer_types")
    if cfg.get("model_type") not in HYBRID_MODEL_TYPES and "linear_attention" not in (types or ()):
        return None
    return hybrid_layer_types(cfg)


def hybrid_layer_types(cfg: dict[str, Any]) -> list[str]:
    """``layer_types`` of a config known to be a hybrid model's, as transformers derives
    them where it names none: every ``full_attention_interval``-th layer full."""
    interval = int(cfg.get("full_attention_interval", 4))
    return list(cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(int(cfg["num_hidden_layers"]))
    ])  # fmt: skip


def linear_heads(cfg: dict[str, Any]) -> tuple[int, int]:
    """(key heads, value heads) of a hybrid model's linear-attention layers, (B/C groups,
    heads) of Mamba-2 ones (``text_config``'s keys); (0, 0) for other models."""
    if layer_types(cfg) is None:
        return 0, 0
    if cfg.get("model_type") in MAMBA2_MODEL_TYPES:
        return int(cfg["mamba_n_groups"]), int(cfg["mamba_n_heads"])
    dims = {**LINEAR_ATTENTION_DEFAULTS, **cfg}
    return int(dims["linear_num_key_heads"]), int(dims["linear_num_value_heads"])


def linear_state_bytes(cfg: dict[str, Any], tp_size: int = 1) -> int:
    """float32 bytes of one request's linear-attention states on one of ``tp_size``
    ranks (a hybrid model's, ``text_config``'s keys; 0 for others): per linear layer, the
    convolution's last ``kernel - 1`` inputs of its channels and the recurrent states.
    Gated delta rule: q, k and v channels, each value head's ``key_head_dim x
    value_head_dim``. Mamba-2: x, B and C channels, each head's ``head_dim x d_state``;
    with fewer B/C groups than ranks each rank keeps a whole group's B and C."""
    types = layer_types(cfg)
    if types is None:
        return 0
    num_linear = sum(t == "linear_attention" for t in types[: int(cfg["num_hidden_layers"])])
    if cfg.get("model_type") in MAMBA2_MODEL_TYPES:
        heads = int(cfg["mamba_n_heads"]) // tp_size
        groups = max(1, int(cfg["mamba_n_groups"]) // tp_size)
        state, width = int(cfg["mamba_d_state"]), heads * int(cfg["mamba_d_head"])
        conv = (width + 2 * groups * state) * (int(cfg["mamba_d_conv"]) - 1)
        return 4 * (conv + width * state) * num_linear
    dims = {**LINEAR_ATTENTION_DEFAULTS, **cfg}
    key_dim = int(dims["linear_num_key_heads"]) * int(dims["linear_key_head_dim"])
    value_heads, value_dim = int(dims["linear_num_value_heads"]), int(dims["linear_value_head_dim"])
    conv = (2 * key_dim + value_heads * value_dim) * (int(dims["linear_conv_kernel_dim"]) - 1)
    recurrent = value_heads * int(dims["linear_key_head_dim"]) * value_dim
    return 4 * (conv + recurrent) * num_linear // tp_size


def draft_vocab_problem(draft: object, draft_vocab: int, target_vocab: int) -> str | None:
    """Why ``draft`` (a checkpoint of ``draft_vocab`` token ids) cannot draft for a target
    of ``target_vocab``, or None if it can: its ids must be the target's, so it may have
    fewer (padding rows) but never more."""
    if draft_vocab <= target_vocab:
        return None
    return (
        f"{draft}'s vocabulary ({draft_vocab}) is larger than the target's "
        f"({target_vocab}): a draft must use the target's token ids"
    )


# EAGLE-3 heads (``engine.speculative_method: eagle3``): EAGLE's own files and vLLM's
# speculators files (which nest the decoder layer's config in transformer_layer_config).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


def eagle3_layer_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The Llama config of an EAGLE-3 head's decoder layer, from its config.json's
    contents ``raw``; None if ``raw`` is not an EAGLE-3 head's."""
    if not set(raw.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        return None
    return {**raw, **raw.get("transformer_layer_config", {})}


def eagle3_aux_layer_ids(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input states (the residual stream entering layer ``j``;
    0: the embeddings, ``num_target_layers``: the last layer's output) an EAGLE-3 head
    reads, in its fc's order: ``eagle_aux_hidden_state_layer_ids`` (vLLM's key and its
    indexing), else vLLM's and EAGLE's default: layers 2, L/2 and L - 3."""
    nested = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or nested.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids:
        return tuple(int(i) for i in ids)
    return (2, num_target_layers // 2, num_target_layers - 3)


def eagle3_kv_problem(
    head: object, head_kv: tuple[int, int], target_kv: tuple[int, int]
) -> str | None:
    """Why the EAGLE-3 head ``head`` (KV heads, head size ``head_kv``) cannot keep its KV
    as one more layer of the target's cache (``target_kv``), or None if it can."""
    if head_kv == target_kv:
        return None
    return (
        f"{head}'s attention ({head_kv[0]} KV heads of {head_kv[1]}) differs from the "
        f"target's ({target_kv[0]} of {target_kv[1]}): its KV is one more layer of the "
        "target's cache, which moves with the prompt's blocks"
    )
