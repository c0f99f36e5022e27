"""The paged-attention engine shared by both worker roles, and its offline ``LLM`` API.

The names below load on first use (PEP 562), not when the package does: importing a
torch-free submodule (``engine.models.maker``'s names, ``engine.models.fp8_config``) must
not import torch, which costs every ``pdserve`` command ~2.5 s of CPU. The router and the
``pdserve up`` launcher are such commands; only the workers need torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.structured_output import StructuredOutput
    from engine.errors import InvalidRequestError
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.pooling import PoolingParams
    from engine.sampling_params import SamplingParams

_MODULE_OF = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "InvalidRequestError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "PoolingParams": "engine.pooling",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "common.structured_output",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "LLMEngine",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
