"""A checkpoint's calibrated KV-cache scales, collected as the loader meets them.

A checkpoint (of FP8 weights, integer weights, or float weights under a config that
quantizes the KV cache alone) may carry one K and one V scale per layer, for an FP8 KV
cache to store K / k_scale and V / v_scale (vLLM's meaning): llm-compressor's
``self_attn.k_scale``, ModelOpt's ``self_attn.k_proj.k_scale``, others'
``self_attn.attn.k_scale`` or ``self_attn.qkv_proj.k_scale``, older files'
``self_attn.k_proj.output_scale`` and ``self_attn.kv_scale`` (one scale for both; a
layer with only one of K and V uses it for both, as vLLM does). They mean FP8 scales
only where the config declares FP8 KV-cache quantization
(``ModelArchConfig.fp8_kv_scales``); otherwise they are ignored, with a warning. Scales
an FP8 cache could not use (per head, zero, negative, not finite) are recorded as
problems, refused only when the cache is FP8 (``model_shard``): a 16- or 32-bit cache
has no use for any of them.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

_KV_SCALE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\."
    r"(?:(?:attn\.|(?:q|k|v|qkv)_proj\.)?(k|v|kv)_scale|(k|v)_proj\.output_scale)$"
)


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """(layer, "k", "v" or "kv": both) if ``name`` is a layer's calibrated KV-cache scale."""
    match = _KV_SCALE.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or match.group(3)


@dataclass
class KvScaleReader:
    """Collects the KV-cache scales of one checkpoint (``declared``: whether its config
    says they are FP8 scales)."""

    declared: bool
    scales: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> {"k": s}
    problems: list[str] = field(default_factory=list)
    ignored: int = 0

    def add(self, name: str, read: Callable[[], torch.Tensor]) -> None:
        """Take ``name`` (``read`` gives its tensor) if it is a KV-cache scale."""
        found = kv_scale_of(name)
        if found is None:
            return
        if not self.declared:
            self.ignored += 1
            return
        scale = read()
        if scale.numel() != 1 or not scale.is_floating_point():
            self.problems.append(f"{name} holds {scale.numel()} {scale.dtype} values, not one "
                                 "float per layer (per-head scales are not supported)")  # fmt: skip
            return
        value = float(scale.float())
        if not math.isfinite(value) or value <= 0:
            self.problems.append(f"{name} is {value}, not a positive scale")
            return
        layer, which = found
        for side in ("k", "v") if which == "kv" else (which,):
            self.scales.setdefault(layer, {})[side] = value

    def per_layer(self, model_dir: object) -> dict[int, tuple[float, float]]:
        """layer -> (k_scale, v_scale), and a warning if scales were ignored."""
        if self.ignored:
            logger.warning("%s: %d KV-cache scales are ignored: the config declares no FP8 "
                           "KV-cache quantization (kv_cache_scheme / kv_cache_quant_algo)",
                           model_dir, self.ignored)  # fmt: skip
        return {layer: (sides.get("k", sides.get("v")), sides.get("v", sides.get("k")))
                for layer, sides in self.scales.items()}  # fmt: skip
