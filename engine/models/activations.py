"""The GELU variants vision towers and projectors name in their configs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """``quick_gelu`` (CLIP), the tanh GELU (``gelu_pytorch_tanh``, ``gelu_new``: SigLIP,
    Qwen3-VL's tower), else the exact GELU."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)
