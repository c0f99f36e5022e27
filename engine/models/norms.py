"""RMSNorm and its variants: Llama's (cast, then the gain), Gemma's (``1 + weight``, in
float32), GPT-OSS's (the gain in float32, then the cast), and one over a width split across
tensor-parallel ranks (MiniMax-M2's q/k norms)."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch import ModelArchConfig
from engine.parallel.group import TPGroup


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


class SplitRMSNorm(RMSNorm):
    """RMSNorm over a width whose ``dim`` elements here are this rank's equal share of the
    ``group``'s (a q or k projection cut by heads): the mean square is summed across ranks.
    KV heads replicated on several ranks (fewer heads than ranks) count once per replica
    in the sum and in the divisor alike, so the mean is still the whole width's."""

    def __init__(self, dim: int, eps: float, group: TPGroup) -> None:
        super().__init__(dim, eps)
        self.group = group

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().normed(x)
        x = x.to(torch.float32)
        square_sum = self.group.all_reduce(x.pow(2).sum(-1, keepdim=True))
        mean = square_sum / (x.shape[-1] * self.group.size)
        return x * torch.rsqrt(mean + self.eps)
