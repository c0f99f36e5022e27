"""What an engine's settings resolve to on this machine and model, before anything is
built: its device, its dtype, its context length, and whether a hybrid model can run with
them. ``ConfigError`` names the setting at fault."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from common.config_base import ConfigError
from common.engine_config import DType, EngineConfig, max_model_len_problem
from engine.models.arch import ModelArchConfig

logger = logging.getLogger(__name__)

_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.BFLOAT16: torch.bfloat16,
}


def resolve_device(config: EngineConfig) -> torch.device:
    """``engine.device``; "cuda" where torch sees no CUDA device is a ``ConfigError`` (it
    failed later, inside torch, as an assertion)."""
    if config.device.value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device.value == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError("engine.device", f"cuda, but torch ({torch.__version__}, {build}) "
                          "sees no CUDA device here; use cpu or auto")  # fmt: skip
    return torch.device(config.device.value)


def resolve_dtype(config: EngineConfig, arch: ModelArchConfig, device: torch.device) -> torch.dtype:
    if config.dtype is not DType.AUTO:
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32  # no fast bf16/fp16 matmuls on most CPUs
    if arch.torch_dtype in ("bfloat16", "float16"):
        return _DTYPES[DType(arch.torch_dtype)]
    return torch.bfloat16


def resolve_max_model_len(config: EngineConfig, arch: ModelArchConfig) -> int:
    """``max_model_len``, or the model's context when unset. Beyond the model's context
    it is a ``ConfigError``, as in vLLM: it was cut to the context with a warning in the
    worker's log, so a deployment configured for 100k tokens came up serving 4k and
    refused longer prompts as too long."""
    limit = arch.max_context_len or arch.max_position_embeddings
    if config.max_model_len is None:
        return limit
    problem = max_model_len_problem(config.max_model_len, limit)
    if problem is not None:
        raise ConfigError("engine.max_model_len", problem)
    return config.max_model_len


def check_hybrid(config: EngineConfig, arch: ModelArchConfig, model_dir: Path) -> None:
    """Refuse what a hybrid model (linear-attention layers: ``engine/linear_state.py``)
    cannot run with yet (``EngineConfig.hybrid_problem``); nothing for any other model.
    Its recurrent states depend on every earlier token, so a cached prefix serves only
    with a snapshot of the states after it, which the prefix cache and the CPU tier keep
    beside the KV (``kv_cache_manager.py``). Raises ``ConfigError``."""
    problem = config.hybrid_problem() if arch.linear_attention is not None else None
    if problem is not None:
        raise ConfigError(f"engine.{problem[0]}", f"{model_dir.name}: {problem[1]}")
