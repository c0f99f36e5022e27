"""What a dataset is made of: its name and options. Import-light (no numpy), so the
command line can describe its flags without loading the builders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "prefix-repetition", "multi-turn", "mooncake", "azure")
TRACE_DATASETS = ("mooncake", "azure")
# Synthetic ids are drawn below this: it fits every real vocabulary (and the built-in tiny
# model's 2048).
DEFAULT_VOCAB_SIZE = 1000


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """Every dataset option; each builder reads the ones it documents.

    Lengths are in tokens. ``range_ratio`` r draws each synthetic length uniformly from
    ``[len*(1-r), len*(1+r)]``. Caps (``max_*_tokens``) clip every turn of every dataset.
    """

    name: str
    num_requests: int = 100
    input_len: int = 128  # random, multi-turn: per turn; prefix-repetition: the suffix
    output_len: int = 32
    range_ratio: float = 0.0
    prefix_len: int = 256  # prefix-repetition: shared prefix length
    num_prefixes: int = 4  # prefix-repetition: distinct shared prefixes
    turns: int = 4  # multi-turn: turns per conversation
    think_time_s: float = 0.0  # multi-turn: pause between a reply and the next turn
    trace: Path | None = None  # trace datasets: the file (default: the shared traces)
    trace_offset: int = 0  # trace datasets: rows skipped before the first one used
    block_tokens: int = 512  # mooncake: tokens per hash id (the trace's blocks are 512)
    input_scale: float = 1.0  # azure: prompt lengths multiplied by this
    output_scale: float = 1.0  # trace datasets: output lengths multiplied by this
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        positive = (
            "num_requests",
            "input_len",
            "output_len",
            "prefix_len",
            "num_prefixes",
            "turns",
            "block_tokens",
        )
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.input_scale <= 0 or self.output_scale <= 0:
            raise ValueError("input_scale and output_scale must be > 0")
        if self.think_time_s < 0 or self.trace_offset < 0:
            raise ValueError("think_time_s and trace_offset must be >= 0")
        for key in ("max_input_tokens", "max_output_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 or unset, got {value}")
