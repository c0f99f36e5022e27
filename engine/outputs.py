"""What the engine hands back: vLLM-shaped output objects, built at the engine's edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import RequestTimes, TokenLogprobs


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
    # Set when a request failed rather than being aborted by its caller; ``error_param``
    # too when that was the request's own fault (the field at fault): invalid input.
    error: str | None = None
    error_param: str | None = None
    # A finished prefill-only request: the blocks holding its prompt's KV, kept for a
    # decode worker until the engine's release_kv(request_id).
    kv_block_ids: list[int] | None = None
    kv_block_hashes: list[bytes] | None = None
    num_remote_blocks_pulled: int = 0
    times: RequestTimes | None = None
    # With SamplingParams.prompt_logprobs, once the prompt is computed: one entry per
    # prompt token, None for the first (nothing precedes it), as vLLM's.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
