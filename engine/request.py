"""A request inside the engine: its tokens, how far its KV is computed, and its state.

There is no prefill or decode phase. ``num_computed_tokens`` catches up with
``num_tokens``; each step the scheduler hands a request some of the difference. A request
whose KV arrives from another worker waits in ``WAITING_FOR_REMOTE_KV`` until it lands and
then continues like any other.

Role differences are two fields, set by the services: ``prefill_only`` (finish after the
first sampled token and keep the blocks for a decode worker to pull) and ``remote_kv``
(the prompt's KV is pulled from another worker instead of computed).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.hashing import BlockHash, prefix_salt
from engine.draft_budget import DraftBudget
from engine.ngram_proposer import TokenHistory
from engine.penalties import TokenCounts
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from common.multimodal import ImageSpan
    from engine.images import PromptImage
    from engine.models.lora import LoraAdapter
    from engine.mrope import MropePositions
    from engine.pooling import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # A prefill-only request that sampled its first token; it continues on a decode worker.
    FINISHED_PREFILLED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_PREFILLED,
}


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """Where a request's prompt KV lives on another worker (see ``engine/kv_connector.py``).

    ``block_ids[i]`` holds the remote tokens ``[i * block_size, (i + 1) * block_size)``;
    ``source`` is opaque to the engine: the connector's reference to the peer."""

    transfer_id: str
    num_tokens: int
    block_ids: tuple[int, ...]
    source: object = None
    # time.monotonic() after which the pull may not start: the peer's lease would
    # run out before the pull could finish, and a pull from released blocks reads whatever
    # the peer put there since. The request then recomputes its prompt instead (or fails,
    # without recompute). None: no limit.
    start_by: float | None = None
    # A hybrid model's: the remote blocks holding its linear-attention states after the
    # prompt (``engine/linear_state.py``); empty for other models.
    state_block_ids: tuple[int, ...] = ()
    # The transfer names of the blocks (``common.hashing.transfer_block_hashes``) as the
    # peer computed them for its prompt; empty: not said (an older peer). The engine pulls
    # only when they are this request's own (``LLMEngine._pulls_this_prompt``).
    block_hashes: tuple[bytes, ...] = ()


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps (seconds) of a request's milestones on this worker."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    fetch_started: float | None = None
    fetch_finished: float | None = None
    finished: float | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probs for one sampled token: its own and the top ``n`` of the distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    cache_salt: str | None = None
    lora: LoraAdapter | None = None  # the LoRA adapter it runs with; None: the base model
    prefill_only: bool = False
    remote_kv: RemoteKV | None = None
    # An embedding request (engine/pooling.py): it finishes when its prompt is computed,
    # with its last hidden state in ``embedding``, and never samples.
    pooling: PoolingParams | None = None
    times: RequestTimes = field(default_factory=RequestTimes)
    # Under the priority policy, lower values are served first (vLLM's convention); under
    # FCFS always 0. The scheduler numbers arrivals (the waiting line's ties go by them)
    # and admissions to ``running`` (the running list's ties, and so its victims).
    priority: int = 0
    arrival_seq: int = 0
    admission_seq: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With sampling_params.prompt_logprobs: entry i scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # What outputs carry once the prompt is scored (``[None, *prompt_logprobs]``): built
    # once and shared, not copied (O(prompt)) into every step's output.
    prompt_logprobs_output: list[TokenLogprobs | None] | None = None
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache (or a remote worker) at first scheduling,
    # and cached blocks a prompt being prefilled took since (get_next_cached_blocks).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Hashes of the request's full blocks, extended as tokens are appended.
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | None = None  # the stop token id that ended it, if any
    error: str | None = None  # why an aborted request failed, if it did not just get aborted
    # With an error that is the request's own fault (a constraint llguidance gave up on
    # mid-generation): the field at fault. Services answer it as invalid input, not as
    # a failure of the worker.
    error_param: str | None = None
    num_remote_blocks_pulled: int = 0
    # A waiting pulled prompt held for another request's pull: the index of the block it
    # waits for (``Scheduler._waits_for_pull``); None: not known to wait.
    waits_for_block: int | None = None
    embedding: torch.Tensor | None = None  # an embedding request's, once computed
    token_counts: TokenCounts | None = None  # penalised requests: what the sampler counted
    # Speculating requests: their tokens as an array, for the n-gram proposer, and how
    # many drafts their steps may verify.
    token_history: TokenHistory | None = None
    draft_budget: DraftBudget | None = None
    # The drafts a model proposed after its last step (the MTP layer's or a draft
    # model's: ``engine/mtp_drafts.py``), valid while the request has
    # ``model_drafts_after`` tokens: they continue exactly those.
    model_draft_ids: list[int] = field(default_factory=list)
    model_drafts_after: int = 0
    # With a draft model: it holds KV for positions 0 .. draft_kv_end - 1, as of the last
    # step this request took part in (``engine/draft_model.py``).
    draft_kv_end: int = 0
    # A vision-language model's images in the prompt (``engine/images.py``), and the
    # encoder output kept for those a chunked prompt is part-way through.
    images: tuple[PromptImage, ...] = ()
    image_features: dict[int, torch.Tensor] = field(default_factory=dict)
    # Rotary positions where they are not the sequence's (Qwen2.5-VL with images:
    # ``engine/mrope.py``); None: position i rotates by i.
    mrope: MropePositions | None = None

    def set_model_drafts(self, draft_ids: list[int]) -> None:
        """A model's drafts after the request's tokens as they are now."""
        self.model_draft_ids, self.model_drafts_after = draft_ids, self.num_tokens

    @property
    def current_model_drafts(self) -> list[int]:
        """The model's drafts that continue the request's tokens; none if it changed since."""
        return self.model_draft_ids if self.model_drafts_after == self.num_tokens else []

    @property
    def queue_order(self) -> tuple[int, int]:
        """Where the request stands in the waiting line: smaller first."""
        return (self.priority, self.arrival_seq)

    @property
    def running_order(self) -> tuple[int, int]:
        """Where it stands among running requests: smaller first, the last one preempted
        first (under FCFS: the most recently admitted, as vLLM)."""
        return (self.priority, self.admission_seq)

    @property
    def scores_prompt(self) -> bool:
        """Whether the request still needs log-probs of prompt tokens: then no prefix-cache
        hit may skip computing a prompt token."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def image_spans(self) -> tuple[ImageSpan, ...]:
        """Where the prompt's images sit, and their digests (what its blocks are keyed by)."""
        return tuple(image.span for image in self.images)

    @property
    def prefix_salt(self) -> str | bytes | None:
        """The salt of its block hashes: KV is shared only within one tenant (cache_salt)
        and one adapter (its KV differs from the base model's for the same tokens)."""
        return prefix_salt(self.cache_salt, self.lora.key if self.lora else None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end`` of prompt + output, copying only those: the two lists
        are kept apart, and joining them (O(sequence)) for every request on every step
        was most of the engine's host time per step at long contexts."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: the request's own limit, bounded by max_model_len."""
        room = self.max_model_len - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return max(1, room if limit is None else min(limit, room))

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token puts the request in, if any."""
        num_output = self.num_output_tokens
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.prefill_only:
            return RequestStatus.FINISHED_PREFILLED
        return None

    @property
    def may_speculate(self) -> bool:
        """Whether drafts may be verified for this request: it decodes (one token to
        compute), continues here (not prefill-only, not an embedding), and has no grammar
        (its mask at a draft's position would need the matcher advanced through the drafts
        before it and rolled back; not done). The scheduler caps the drafts by the tokens
        left."""
        return (
            not self.prefill_only
            and self.pooling is None
            and self.sampling_params.structured_output is None
            and self.num_tokens - self.num_computed_tokens == 1
        )

    def token_ids_banned_now(self) -> frozenset[int]:
        """Tokens that may not be sampled yet because min_tokens is not reached."""
        if self.num_output_tokens >= self.sampling_params.min_tokens:
            return frozenset()
        return self.sampling_params.ids_banned_before_min_tokens(self.eos_token_ids)
