"""A mixture-of-experts checkpoint's experts, read from its config.json into a
``MoeConfig``: Mixtral's and Qwen's layout, Granite 4.0-H's and Nemotron-H's, DeepSeek's
(with GLM-4.5 and MiniMax-M2, which route as DeepSeek-V3 does) and GPT-OSS's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.models.arch_flags import ARCHITECTURES, ArchFlags
from engine.models.arch_parts import MoeConfig
from engine.models.errors import ModelLoadError, require


def moe_config(
    cfg: dict[str, Any], architecture: str, num_layers: int, path: Path
) -> MoeConfig | None:
    """The experts of ``architecture``'s config ``cfg`` over ``num_layers`` layers (the
    MTP layers' too), or None for a dense model; ``path`` names the file in errors."""
    flags = ARCHITECTURES[architecture]
    if flags.granite_hybrid:
        return _granite_moe(cfg, num_layers, path)
    if flags.nemotron_h:
        return _nemotron_h_moe(cfg, num_layers, path)
    if not flags.moe:
        return None
    if flags.deepseek_router:
        return _deepseek_moe(cfg, architecture, flags, num_layers, path)
    # Mixtral and transformers 5 write num_local_experts; Qwen's checkpoints num_experts.
    num_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if num_experts is None:
        raise ModelLoadError(f"{path}: config.json has no 'num_experts' or 'num_local_experts'")
    top_k = int(require(cfg, "num_experts_per_tok", path))
    if not 0 < top_k <= int(num_experts):
        raise ModelLoadError(f"{path}: num_experts_per_tok={top_k} of {num_experts} experts")
    # Mixtral's experts are intermediate_size wide; Qwen's moe_intermediate_size, and
    # intermediate_size is then the width of their dense layers.
    width_key = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    if step < 1:
        raise ModelLoadError(f"{path}: decoder_sparse_step={step} must be >= 1")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if not all(sparse) and "intermediate_size" not in cfg:
        raise ModelLoadError(f"{path}: config.json has no 'intermediate_size' for its dense layers")
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=top_k,
        expert_intermediate_size=int(require(cfg, width_key, path)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", flags.norm_topk_prob)),
        routing_weights_in_model_dtype=flags.routing_weights_in_model_dtype,
        shared_expert_intermediate_size=(
            int(require(cfg, "shared_expert_intermediate_size", path)) if flags.shared_expert else 0
        ),
        sparse_layers=sparse,
        **(_gpt_oss_moe(cfg) if flags.gpt_oss else {}),
    )


def _granite_moe(cfg: dict[str, Any], num_layers: int, path: Path) -> MoeConfig | None:
    """Granite 4.0-H's experts (``text_config``'s keys), None without any: every layer
    routes to the top ``num_experts_per_tok``, weighted by the softmax over their logits,
    and adds its shared MLP, ungated."""
    num_experts = int(cfg["num_local_experts"] or 0)
    if not num_experts:
        return None
    top_k = int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(f"{path}: num_experts_per_tok={top_k} of {num_experts} experts")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=False,
        routing_weights_in_model_dtype=True,
        shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
        sparse_layers=(True,) * num_layers,
        softmax_over_top_k=True,
        shared_expert_gated=False,
    )


def _check_expert_groups(
    num_experts: int, top_k: int, num_groups: int, topk_groups: int, path: Path
) -> None:
    """DeepSeek's router's choice (``DeepseekGate``) is possible: the experts split into
    ``num_groups`` equal groups, ``topk_groups`` of them kept, and those hold ``top_k``
    experts. Raises ``ModelLoadError``."""
    if num_experts % num_groups or not 0 < topk_groups <= num_groups:
        raise ModelLoadError(f"{path}: {num_experts} experts in n_group={num_groups} groups, "
                             f"topk_group={topk_groups}")  # fmt: skip
    if not 0 < top_k <= num_experts * topk_groups // num_groups:
        raise ModelLoadError(f"{path}: num_experts_per_tok={top_k} of the {topk_groups} "
                             "groups' experts")  # fmt: skip


def _nemotron_h_moe(cfg: dict[str, Any], num_layers: int, path: Path) -> MoeConfig | None:
    """Nemotron 3's mixture-of-experts layers ("moe" in ``layer_types``), None without any:
    DeepSeek-V3's router (sigmoid scores, a choice-only bias, groups, scaled weights) over
    ungated squared-ReLU experts, and one ungated shared expert of its own width; with
    ``moe_latent_size`` (Nemotron 3 Super) the experts run that wide, between latent
    projections."""
    sparse = tuple(t == "moe" for t in cfg["layer_types"][:num_layers])
    if not any(sparse):
        return None
    latent = cfg.get("moe_latent_size")
    num_experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    num_groups, topk_groups = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    _check_expert_groups(num_experts, top_k, num_groups, topk_groups, path)
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routing_weights_in_model_dtype=False,
        shared_expert_intermediate_size=int(cfg["moe_shared_expert_intermediate_size"]),
        sparse_layers=sparse,
        deepseek_scoring="sigmoid",
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        shared_expert_gated=False,
        expert_activation="relu2",
        latent_size=None if latent is None else int(latent),
    )


# DeepseekV2Config's, DeepseekV3Config's and Glm4MoeConfig's defaults (transformers 5) for
# the keys below.
DEEPSEEK_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": {
        "n_routed_experts": 64, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0, "topk_method": "greedy", "q_lora_rank": 1536,
    },
    "DeepseekV3ForCausalLM": {
        "n_routed_experts": 256, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "q_lora_rank": 1536,
    },
    "Glm4MoeForCausalLM": {
        "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    },
    "MiniMaxM2ForCausalLM": {
        "n_routed_experts": 256, "n_shared_experts": 0, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
    },
}  # fmt: skip


def _deepseek_moe(
    cfg: dict[str, Any], architecture: str, flags: ArchFlags, num_layers: int, path: Path
) -> MoeConfig:
    """DeepSeek's experts: ``n_routed_experts`` routed (``MoeConfig.deepseek_scoring``) and
    ``n_shared_experts`` of ``moe_intermediate_size`` run by every token as one MLP; the
    first ``first_k_dense_replace`` layers (then all but every ``moe_layer_freq``-th) dense."""
    cfg = {**DEEPSEEK_DEFAULTS[architecture], **{k: v for k, v in cfg.items() if v is not None}}
    num_experts = int(cfg.get("num_local_experts", cfg["n_routed_experts"]))
    top_k = int(require(cfg, "num_experts_per_tok", path))
    # MiniMax-M2's experts are intermediate_size wide (it has no dense MLP).
    width_key = "intermediate_size" if flags.minimax_m2 else "moe_intermediate_size"
    width = int(require(cfg, width_key, path))
    num_groups, topk_groups = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if flags.deepseek_router == 2:  # V2's topk_method says whether groups limit the choice
        method = cfg["topk_method"]
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(f"{path}: topk_method {method!r} is not supported for "
                                 "DeepSeek-V2 (greedy, group_limited_greedy)")  # fmt: skip
        if method == "greedy":
            num_groups = topk_groups = 1
    _check_expert_groups(num_experts, top_k, num_groups, topk_groups, path)
    first_dense = int(cfg["first_k_dense_replace"])
    frequency = int(cfg.get("moe_layer_freq", 1))
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=width,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", flags.norm_topk_prob)),
        routing_weights_in_model_dtype=False,
        shared_expert_intermediate_size=width * int(cfg["n_shared_experts"] or 0),
        sparse_layers=tuple(i >= first_dense and i % frequency == 0 for i in range(num_layers)),
        deepseek_scoring="softmax" if flags.deepseek_router == 2 else "sigmoid",
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
    )


def _gpt_oss_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """MoeConfig's GPT-OSS fields (``swiglu_alpha`` is not in its configs: 1.702 always)."""
    return {
        "router_bias": True,
        "expert_bias": True,
        "softmax_over_top_k": True,
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
    }
