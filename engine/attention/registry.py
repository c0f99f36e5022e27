"""Attention backends by name. ``auto`` is triton on CUDA and torch elsewhere, and torch for
models with latent attention (DeepSeek): their decode kernel (``kernels/mla_decode.py``) is
verified in Triton's interpreter but not yet measured on a GPU, so it is chosen explicitly
(``attention_backend: triton``) until it is."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import AttentionBackendName, ConfigError
from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def _triton_backend(block_size: int, device: torch.device) -> AttentionBackend:
    """Refused on a CPU unless Triton interprets its kernels (``TRITON_INTERPRET=1``, as
    the tests run them): compiled kernels need CUDA tensors, and a worker started with
    them failed each request at its first step instead of refusing to start."""
    try:
        from engine.attention.triton_backend import TritonAttentionBackend
        from kernels.kv_store import kernels_interpreted
    except ImportError as exc:
        raise RuntimeError(
            f"attention_backend=triton needs the triton package and its backend: {exc}"
        ) from exc
    if device.type != "cuda" and not kernels_interpreted():
        raise ConfigError(
            "engine.attention_backend",
            f"triton needs a CUDA device (the engine runs on {device}); use torch or auto, "
            "or set TRITON_INTERPRET=1 to interpret the kernels on the CPU (slow: tests)",
        )
    return TritonAttentionBackend()


_BACKENDS: dict[AttentionBackendName, Callable[[int, torch.device], AttentionBackend]] = {
    AttentionBackendName.TORCH: lambda block_size, device: TorchAttentionBackend(block_size),
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
    return _BACKENDS[resolve_backend_name(name, device, latent_attention)](block_size, device)
