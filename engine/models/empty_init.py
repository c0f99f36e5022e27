"""Turn a module built on the meta device into real, uninitialised storage, in its dtype.

Models are built under ``torch.device("meta")`` (no memory, no random init) and then
given storage that the checkpoint fills. ``Module.to_empty(device).to(dtype)`` did that
in two steps: every floating tensor was first allocated in the default dtype (float32)
and then copied into ``dtype``, so a bf16 model peaked at three times its size on the
device (an 8B model: 32 GB of float32, then 16 GB more), and ``to_empty``'s
``empty_like`` of a meta tensor goes through torch's Python reference ops, whose first
call imports sympy (~0.9 s of every worker's and TP shard's start, and its objects make
the start's garbage-collector pass slower). ``materialize`` allocates each tensor once,
with ``torch.empty`` in its final dtype.
"""

from __future__ import annotations

import torch
from torch import nn


def materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``module`` with every parameter and buffer replaced by an uninitialised tensor of
    the same shape on ``device``: floating tensors in ``dtype`` (as ``Module.to(dtype)``
    converts them), others (integer tables) in their own dtype. Returns ``module``.
    Unlike ``to_empty``, every tensor is contiguous (a meta tensor's strides are not
    kept), and a complex one stays complex (``.to(dtype)`` dropped its imaginary part);
    no model here builds either."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    return module._apply(empty)
