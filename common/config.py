"""Configuration schema. Torch-free, so the router and the CLI can validate without torch.

Each process builds its config once at its entry point and hands the fields down; configs
are frozen. Enum-typed fields accept their string values and are converted on construction,
so a config read from YAML and one written in Python compare equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or impossible. Names the dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class AttentionBackendName(StrEnum):
    AUTO = "auto"  # triton on CUDA, torch elsewhere
    TORCH = "torch"
    TRITON = "triton"


class DType(StrEnum):
    AUTO = "auto"  # the checkpoint's dtype on CUDA, float32 on CPU (no fast bf16 there)
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Device(StrEnum):
    AUTO = "auto"  # cuda when available
    CPU = "cpu"
    CUDA = "cuda"


def _coerce_enums(obj: Any) -> None:
    """Turn string values of enum-typed fields into the enum, for frozen dataclasses."""
    for field in dataclasses.fields(obj):
        enum_type = _ENUM_FIELDS.get(field.type) if isinstance(field.type, str) else None
        if enum_type is None:
            continue
        value = getattr(obj, field.name)
        if not isinstance(value, enum_type):
            try:
                object.__setattr__(obj, field.name, enum_type(value))
            except ValueError:
                choices = ", ".join(member.value for member in enum_type)
                raise ConfigError(field.name, f"{value!r} is not one of: {choices}") from None


_ENUM_FIELDS: dict[str, type[StrEnum]] = {
    "AttentionBackendName": AttentionBackendName,
    "DType": DType,
    "Device": Device,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one paged-attention engine; the same for both worker roles."""

    dtype: DType = DType.AUTO
    device: Device = Device.AUTO
    block_size: int = 16
    # KV blocks in the pool. None: sized from kv_cache_bytes (CPU) or
    # gpu_memory_utilization (CUDA) after the weights are loaded.
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    # None: the checkpoint's max_position_embeddings (capped by its sliding window, if any).
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Most prompt tokens one request may compute in one step. None: only the step budget
    # limits it. Small values interleave long prompts with decodes more finely.
    prefill_chunk_tokens: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: AttentionBackendName = AttentionBackendName.AUTO
    seed: int = 0

    def __post_init__(self) -> None:
        _coerce_enums(self)
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(f"engine.{key}", f"must be > 0, got {getattr(self, key)}")
        for key in ("num_blocks", "max_model_len", "prefill_chunk_tokens"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"engine.{key}", f"must be > 0 or null, got {value}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "engine.gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}",
            )

    def replace(self, **changes: Any) -> EngineConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"engine.{sorted(unknown)[0]}", "unknown engine setting")
        return dataclasses.replace(self, **changes)
