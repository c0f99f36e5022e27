"""The paged-attention engine shared by both worker roles, and its offline ``LLM`` API."""

from common.structured_output import StructuredOutput
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

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
