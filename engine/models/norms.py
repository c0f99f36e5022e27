"""RMSNorm and its variants: Llama's (cast, then the gain), Gemma's (``1 + weight``, in
float32) and GPT-OSS's (the gain in float32, then the cast)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch import ModelArchConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def normed(self, x: torch.Tensor) -> torch.Tensor:  # float32, before the gain
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normed(x).to(x.dtype)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by ``1 + weight`` (the stored weight is an offset from 1),
    and multiplies before casting back, in float32 (Llama casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normed(x) * (1.0 + self.weight.float())).type_as(x)


class Float32GainRMSNorm(RMSNorm):
    """GPT-OSS's RMSNorm: the gain multiplies in float32, then the result is cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * self.normed(x)).to(x.dtype)


def rms_norm(arch: ModelArchConfig, dim: int) -> RMSNorm:
    if arch.norm_unit_offset:
        return UnitOffsetRMSNorm(dim, arch.rms_norm_eps)
    if arch.norm_gain_in_float32:
        return Float32GainRMSNorm(dim, arch.rms_norm_eps)
    return RMSNorm(dim, arch.rms_norm_eps)
