"""What the engine hands back: vLLM-shaped output objects, built at the engine's edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import RequestTimes, TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, eq=False)
class CompletionOutput:
    """A completion as one step left it.

    ``token_ids`` and ``logprobs`` read the request's own lists up to the lengths they had
    when this output was made. Making an output copies nothing: a copy each step cost
    O(tokens so far) per request and step, 44 us at 32k tokens, paid by every running
    request. Each read returns a new list (O(tokens)), so read them once. The engine only
    ever appends to those lists, so an output goes on saying what it said when it was
    made, whatever the engine does after (``tests/engine/test_outputs.py``)."""

    index: int
    token_source: list[int] = field(repr=False)  # the request's list: read ``token_ids``
    num_tokens: int
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    # The stop token id that ended it, if any (offline, ``engine/llm.py``: or stop string).
    stop_reason: int | str | None = None
    # The request's log-prob list (``logprobs``): None when it did not ask for them.
    logprob_source: list[TokenLogprobs] | None = field(default=None, repr=False)
    num_logprobs: int = 0

    @property
    def token_ids(self) -> list[int]:
        """Every token generated so far (a new list)."""
        return self.token_source[: self.num_tokens]

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """Their log-probs (a new list); None when the request did not ask for them."""
        if self.logprob_source is None:
            return None
        return self.logprob_source[: self.num_logprobs]

    def last_logprobs(self, count: int) -> list[TokenLogprobs]:
        """The log-probs of the last ``count`` tokens (fewer if some came without any, as
        tokens handed in with a resumed request do); copies only those."""
        if self.logprob_source is None or count <= 0:
            return []
        return self.logprob_source[max(self.num_logprobs - count, 0) : self.num_logprobs]

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
    # The error is the engine's, not the request's: the engine thread stopped (every
    # request it held failed alike; a worker reports itself unavailable).
    engine_failed: bool = False
    # A finished prefill-only request: the blocks holding its prompt's KV, kept for a
    # decode worker until the engine's release_kv(request_id).
    kv_block_ids: list[int] | None = None
    # A finished prefill-only request with an MTP layer: its drafts after the first token,
    # for the decode worker's first step (``LLMEngine.add_request(draft_token_ids=...)``).
    draft_token_ids: list[int] = field(default_factory=list)
    num_remote_blocks_pulled: int = 0
    times: RequestTimes | None = None
    # With SamplingParams.prompt_logprobs, once the prompt is computed: one entry per
    # prompt token, None for the first (nothing precedes it), as vLLM's. One list shared
    # by the request's outputs: read it, do not change it.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # An embedding request's vector (``engine/pooling.py``), on its finished output:
    # [hidden_size] float32 on the CPU, or [len(pooling.token_ids)] logits where the
    # request named tokens (vLLM gives a list; ``.tolist()`` makes one).
    embedding: torch.Tensor | None = None
