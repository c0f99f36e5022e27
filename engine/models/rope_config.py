"""A rotary embedding's settings, read from config.json as transformers reads them.

Types: default, linear, llama3 and YaRN, plus Phi-3's partial rotary. longrope (Phi-3 128k,
Phi-3.5, Phi-4-mini) is refused: transformers switches tables when a forward pass's
longest position passes the pretraining length, keeping the keys cached under the other
table, and a continuous batch has no such single moment. ``rope.py`` builds the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.hf_config import rope_params
from engine.models.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One rotary embedding, as transformers' ``rope_parameters`` describe it."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn: rotations where interpolation starts / ends
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are scaled by this
    # Phi-3: only the first ``int(head_dim * partial_rotary_factor)`` dims of a head rotate.
    partial_rotary_factor: float = 1.0
    # Qwen2.5-VL's M-RoPE: the rotary's frequency pairs in three sections, rotated by a
    # token's time, row and column positions (``engine/mrope.py``); None: one position.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL's: the pairs take time, row and column in turn (pair j: row if j % 3 == 1
    # and j < 3 * sections[1], column if j % 3 == 2 and j < 3 * sections[2], else time).
    mrope_interleaved: bool = False

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def rope_config(
    cfg: dict[str, Any], path: Path, phi3: bool = False, partial: bool = False
) -> RopeConfig:
    """``phi3``: Phi-3's reading (a partial rotary, and its legacy names of longrope);
    ``partial``: the partial rotary only (GLM-4.5). Other models rotate whole heads."""
    params = rope_params(cfg)
    if phi3 or partial:  # partial_rotary_factor from rope_parameters or the top level
        params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    else:
        params.pop("partial_rotary_factor", None)
    if phi3 and params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"  # Phi-3's old names for it, as transformers reads
    return _rope_from_params(params, cfg.get("rope_theta", 10000.0), cfg, path)


def gemma3_ropes(cfg: dict[str, Any], path: Path) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's rotary for its full-attention layers and for its sliding-window layers.

    transformers 5 writes ``rope_parameters`` per layer type; transformers 4's configs have
    ``rope_theta`` + ``rope_scaling`` (full layers) and ``rope_local_base_freq`` (sliding
    layers, always unscaled). Defaults as ``Gemma3TextConfig``: bases 1e6 and 1e4."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    sliding = dict(params.get("sliding_attention") or {})
    if not full:
        full = dict(cfg.get("rope_scaling") or {})
    full_theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    sliding_theta = sliding.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return (
        _rope_from_params(full, full_theta, cfg, path),
        _rope_from_params(sliding, sliding_theta, cfg, path),
    )


def _rope_from_params(
    params: dict[str, Any], theta: float, cfg: dict[str, Any], path: Path
) -> RopeConfig:
    theta = params.get("rope_theta", theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # transformers 4's name for Qwen2-VL's: default frequencies
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        # longrope (Phi-3 128k, Phi-3.5, Phi-4-mini) switches tables when a sequence passes
        # the pretraining length, after its earlier keys were rotated with the other table:
        # transformers does it per forward pass, which a batch of sequences cannot match.
        raise ModelLoadError(
            f"{path}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    # As transformers: the scaled types need their factors (a KeyError there), and llama3's
    # original context defaults to max_position_embeddings.
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                  "high_freq_factor")}  # fmt: skip
    missing = [key for key in required.get(rope_type, ()) if key not in params]
    if missing:
        raise ModelLoadError(f"{path}: rope type {rope_type!r} needs {', '.join(missing)}")
    # A pretraining length at the config's top level (Phi-3's) wins, as in transformers.
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings")
    if original is None:
        original = cfg.get("max_position_embeddings", 2048)
    factor = params.get("factor")
    if rope_type == "yarn" and factor is None:  # DeepSeek's: the context's growth
        factor = cfg.get("max_position_embeddings", original) / original
    factor = float(factor if factor is not None else 1.0)
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=_yarn_attention_factor(params, factor) if rope_type == "yarn" else 1.0,
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        mrope_section=tuple(int(n) for n in section)
        if (section := params.get("mrope_section"))
        else None,
    )


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale: given, or ``0.1 ln(factor) + 1`` (DeepSeek: a ratio of two)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)
