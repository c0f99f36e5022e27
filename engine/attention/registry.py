"""Attention backends by name. ``auto`` is triton on CUDA and torch elsewhere, and torch for
models with latent attention (DeepSeek): their decode kernel (``kernels/mla_decode.py``) is
verified in Triton's interpreter but not yet measured on a GPU, so it is chosen explicitly
(``attention_backend: triton``) until it is."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config_base import ConfigError
from common.engine_config import AttentionBackendName
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
    latent_widths: tuple[int, int] | None = None,
) -> AttentionBackend:
    """``latent_widths``: a latent-attention model's ``(kv_lora_rank, qk_rope_head_dim)``.
    Triton's latent decode kernel tiles each whole (``kernels/mla_decode.py``), so other
    widths than powers of two (from 16) are refused here, at start: such an engine ran
    its prompts (the torch path) and failed every request at its first decode step."""
    resolved = resolve_backend_name(name, device, latent_widths is not None)
    # (tl.dot's inner dimension is at least 16 on a GPU: smaller widths compile nowhere)
    tiled = latent_widths is None or all(w >= 16 and not w & (w - 1) for w in latent_widths)
    if resolved is AttentionBackendName.TRITON and not tiled:
        kv_lora_rank, rope = latent_widths
        raise ConfigError(
            "engine.attention_backend",
            f"triton's latent-attention decode needs kv_lora_rank and qk_rope_head_dim "
            f"to be powers of two from 16 (this model's: {kv_lora_rank} and {rope}); use "
            "torch or auto",
        )
    return _BACKENDS[resolved](block_size, device)
