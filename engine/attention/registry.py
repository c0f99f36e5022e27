"""Attention backends by name. ``auto`` is triton on CUDA and torch elsewhere, and torch for
models with latent attention (DeepSeek), which the Triton kernels do not cover yet."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import AttentionBackendName, ConfigError
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
    if name is AttentionBackendName.TRITON and latent_attention:
        raise ConfigError(
            "engine.attention_backend",
            "the triton backend has no latent-attention (DeepSeek MLA) kernel yet; use torch "
            "or auto",
        )
    return name


def create_backend(
    name: AttentionBackendName,
    device: torch.device,
    block_size: int,
    latent_attention: bool = False,
) -> AttentionBackend:
    return _BACKENDS[resolve_backend_name(name, device, latent_attention)](block_size)
