"""Attention backends by name. ``auto`` is triton on CUDA and torch elsewhere, and torch for
models with latent attention (DeepSeek): their decode kernel (``kernels/mla_decode.py``) is
verified in Triton's interpreter but not yet measured on a GPU, so it is chosen explicitly
(``attention_backend: triton``) until it is."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import AttentionBackendName
from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def _triton_backend(block_size: int) -> AttentionBackend:
    try:
        from engine.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        raise RuntimeError(
            f"attention_backend=triton needs the triton package and its backend: {exc}"
        ) from exc
    return TritonAttentionBackend()


_BACKENDS: dict[AttentionBackendName, Callable[[int], AttentionBackend]] = {
    AttentionBackendName.TORCH: TorchAttentionBackend,
    AttentionBackendName.TRITON: _triton_backend,
}


def resolve_backend_name(
    name: AttentionBackendName, device: torch.device, latent_attention: bool = False
) -> AttentionBackendName:
    if name is AttentionBackendName.AUTO:
        cuda = device.type == "cuda" and not latent_attention
        return AttentionBackendName.TRITON if cuda else AttentionBackendName.TORCH
    return name


def create_backend(
    name: AttentionBackendName,
    device: torch.device,
    block_size: int,
    latent_attention: bool = False,
) -> AttentionBackend:
    return _BACKENDS[resolve_backend_name(name, device, latent_attention)](block_size)
