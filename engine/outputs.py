"""What the engine hands back: vLLM-shaped output objects, built at the engine's edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | None = None  # the stop token id that ended it, if any
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step. ``outputs[0].token_ids`` holds every token so far;
    ``new_token_ids`` only those added by the step that produced this object."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    prompt: str | None = None
