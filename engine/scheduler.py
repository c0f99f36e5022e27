"""Continuous batching under a per-step token budget, preemption by recompute.

Requests wait in ``Request.queue_order`` (priority, then arrival) and run in
``Request.running_order`` (priority, then admission); under FCFS every priority is 0.
Each step walks the running requests and the head of the waiting line merged, until the
budget runs out: a running request gets the tokens it is missing (``num_tokens -
num_computed_tokens``: a whole or chunked prompt, or the one token it just sampled), a
waiting one is admitted and gets its first chunk. A waiting request goes before running
ones only if its priority value is strictly smaller, so under FCFS all running requests
go first and admissions follow. A running request that cannot get blocks preempts the
last running request (under FCFS the most recently admitted), which frees everything and
later recomputes (mostly from the prefix cache); no one is admitted in a step that
preempted so.

Under the priority policy a waiting request of a smaller value takes the step's budget
before running ones of a larger value (a long low-priority prompt cannot hold it off for
its whole chunked prefill), and when it finds no batch slot or no blocks it preempts
running requests of a strictly larger value, last first, until it fits, if preempting
them all would make room at all. Never for equal values, so two requests can never
preempt each other back and forth; a victim is not readmitted in the same step.

Two role-specific paths, both at the edges of the same loop:

* a request with ``remote_kv`` is admitted by allocating blocks for its prompt, reusing
  what the local prefix cache holds, and asking for the rest to be pulled (``fetches`` of
  the step's output). It waits in ``fetching`` without blocking anyone until
  ``finish_fetch`` says the KV landed (it then continues like any request) or failed
  (it is prefilled locally, or fails, as the caller decides). A pull failed *late* (its
  transport may still write the blocks: ``engine.kv_connector``) leaves its pulled blocks
  quarantined under its transfer id, out of everyone's reach, while the request moves
  on with fresh ones; ``release_quarantine`` frees them once the write has ended. One
  whose next missing block another pull is writing is not admitted until that pull ends
  (then it finds the block cached); the line passes it meanwhile (``_next_admissible``);
* a ``prefill_only`` request finishes after its first token but keeps its blocks in
  ``held`` until ``release_held`` (the decode worker pulled them, or the lease expired).

With ``num_speculative_tokens``, a decoding request may compute draft tokens after its
last one (``ScheduledRequest.draft_token_ids``, from the n-gram proposer or the MTP
layer's drafts): they take
budget and slots like any token, and ``update_from_output`` keeps the KV of those the
sampler accepted. A rejected draft's slot is simply written again by the next step; it
never enters the prefix cache, which registers only blocks full of the request's own
tokens (``block_hashes`` never cover drafts).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.engine_config import EngineConfig
from common.hashing import BlockHash
from common.intmath import cdiv
from engine.block_pool import BlockPoolObserver, KVBlock
from engine.draft_budget import DraftBudget
from engine.images import whole_image_end
from engine.kv_cache_manager import KVCacheManager, SecondaryTier
from engine.ngram_proposer import DraftProposer, ModelDraftProposer, NgramProposer
from engine.request import Request, RequestStatus, TokenLogprobs
from engine.request_queue import RequestQueue

if TYPE_CHECKING:  # (torch's: the scheduler runs without it)
    from engine.linear_state import DraftGroups

# What one step sampled for a request: its tokens in order (one, or more when drafts
# were accepted), each with its log-probs when asked for.
SampledTokens = list[tuple[int, TokenLogprobs | None]]


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_scheduled_tokens: int
    # True when this step computes the request's last missing token, so the step's
    # sampled token extends it; false for a prompt chunk that is not the last.
    samples: bool
    # Proposed tokens computed after the request's own (counted in num_scheduled_tokens).
    draft_token_ids: list[int] = field(default_factory=list)
    # A hybrid model's state snapshots (``kv_cache_manager.py``): the blocks of the one
    # the request starts from (copied into its state slot before the step), and of the
    # one its states are copied into after the step.
    restore_block_ids: list[int] | None = None
    snapshot_block_ids: list[int] | None = None


@dataclass(slots=True)
class FetchOrder:
    """Pull ``remote_block_ids`` into ``local_block_ids`` for ``request``."""

    request: Request
    remote_block_ids: list[int]
    local_block_ids: list[int]
    block_indices: list[int]  # positions of these blocks in the request's block list


@dataclass(slots=True)
class LoadOrder:
    """Copy these blocks from the secondary (CPU) tier into device blocks, this step."""

    block_hashes: list[BlockHash]
    block_ids: list[int]


@dataclass(slots=True)
class _Admission:
    """What admitting a waiting request takes (``Scheduler._plan``)."""

    hits: list[KVBlock]  # cached device blocks of its prefix
    num_hit_tokens: int
    # A hybrid model's: the state snapshot after the hits and loaded blocks, when cached
    # on the device (one the CPU tier holds: ``KVCacheManager.snapshot_loads``).
    restore: list[KVBlock]
    loaded: list[BlockHash]  # the CPU-tier blocks after them, to load
    num_tokens: int  # tokens to allocate slots for after the hits
    pull: bool  # its prompt's KV comes from another worker
    num_new: int = 0  # tokens computed in this step (none for a pull)


def running_order(request: Request) -> tuple[int, int]:
    return request.running_order


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    fetches: list[FetchOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        observers: Iterable[BlockPoolObserver] = (),
        secondary: SecondaryTier | None = None,
        whole_images: bool = False,
        on_blocks_freed: Callable[[str], None] | None = None,
        num_state_blocks: int = 0,
        rolling_snapshots: bool = False,
        draft_groups: DraftGroups | None = None,
    ) -> None:
        """``whole_images``: an image's tokens attend to each other (Gemma 3), so a chunk
        that computes part of an image computes it to its end (``_num_new_tokens``).
        ``on_blocks_freed(request_id)``: called whenever a request's blocks are freed (it
        ended, was aborted or preempted, its pull failed, or its held blocks were
        released); given, held requests count against ``max_num_seqs`` too (a hybrid
        model's states: each request holding blocks holds one of ``max_num_seqs`` state
        slots, ``engine/linear_state.py``). ``num_state_blocks``: the blocks those states
        take, given to keep snapshots of them in the prefix cache (``kv_cache_manager.py``):
        a prompt's chunk then ends at its ``snapshot_boundary``; ``rolling_snapshots``:
        a step that ends at a block boundary after a request's prompt snapshots it too
        (its last one replaced; on a decode worker too, where the router prefills a
        chat's next turn when only that turn is uncached). ``draft_groups``: a hybrid
        model's groups of draft state slots, one held by each request that verifies
        drafts (``linear_state.py``): a decode gets drafts only when it holds one or one
        is free."""
        self.max_num_seqs = config.max_num_seqs
        self.whole_images = whole_images
        self.on_blocks_freed = on_blocks_freed
        self.draft_groups = draft_groups
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.block_size = config.block_size
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, observers, secondary,
            num_state_blocks,
        )  # fmt: skip
        self.waiting = RequestQueue()
        self.running: list[Request] = []  # in running_order
        self.fetching: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.num_state_restores = 0  # admissions that started from a state snapshot
        self.num_state_loads = 0  # ... of which the CPU tier's
        self.rolling_snapshots = rolling_snapshots and self.kv.num_state_blocks > 0
        self.num_blocks_reused_for_remote = 0
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer: DraftProposer | None = None
        after_step = config.speculative_method.drafts_after_step
        # Slots a drafting model writes past a decode step's tokens (``_lookahead``): the
        # MTP layer's or EAGLE-3 head's recursive drafts, k - 1; a draft model reads the
        # sampled token too, one position later (``engine/draft_model.py``), k.
        lookahead = config.num_speculative_tokens
        if config.speculative_method.reads_target_states:
            lookahead = max(lookahead - 1, 0)
        self.draft_lookahead = lookahead if after_step else 0
        if config.num_speculative_tokens and after_step:
            self.proposer = ModelDraftProposer()
        elif config.num_speculative_tokens:
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.num_draft_tokens = 0  # drafts verified (cumulative)
        self.num_accepted_tokens = 0  # of those, kept
        self._num_arrivals = 0
        self._num_admissions = 0
        # Full blocks that pulls in flight are writing (by hash), and each pull's own.
        self._pulling: Counter[BlockHash] = Counter()
        self._pulled_hashes: dict[str, list[BlockHash]] = {}

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests
        assert request.request_id not in self.held
        self.kv.update_block_hashes(request)
        self.requests[request.request_id] = request
        request.arrival_seq = self._num_arrivals
        self._num_arrivals += 1
        self.waiting.push(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort an unfinished request. One whose KV is being pulled stays in ``fetching``
        (its blocks are still being written) until ``finish_fetch`` frees it."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request_id in self.fetching:
            request.status = RequestStatus.FINISHED_ABORTED
            del self.requests[request_id]
            return request
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def stop_early(self, request: Request) -> None:
        """Finish a request that just sampled a token and has nothing left to generate (its
        structured output is complete) as stopped. A prefill-only one held for a decode
        worker frees its blocks instead: no decode worker will pull them."""
        if request.status is RequestStatus.FINISHED_PREFILLED:
            self.release_held(request.request_id)
            request.status = RequestStatus.FINISHED_STOPPED
            return
        assert request.status is RequestStatus.RUNNING, request.status
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished prefill-only request kept for its decode worker."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self._free_blocks(request)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_requests_or_pulls(self) -> bool:
        """Requests or pulls in flight: what the engine loop steps for promptly."""
        return bool(self.requests or self.fetching)

    @property
    def has_work(self) -> bool:
        """Anything the engine loop must keep stepping for (pulls in flight included, and
        quarantined blocks: a step polls for their release)."""
        return self.has_requests_or_pulls or bool(self.kv.quarantined)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed: the prefill backlog."""
        queued = sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.waiting)
        return queued + sum(
            max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.running
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0  # self.running[:index] are scheduled this step
        skip: set[str] = set()  # not admitted this step: preempted in it, or waiting for a pull
        head = self._next_admissible(skip)  # None: no more admissions this step
        while budget > 0:
            # A waiting request goes before running ones of a larger priority value only.
            if index < len(self.running) and (
                head is None or self.running[index].priority <= head.priority
            ):
                num_preempted = len(out.preempted_ids)
                num_scheduled = self._schedule_running(self.running[index], out, budget)
                if len(out.preempted_ids) > num_preempted:  # out of blocks: admit no one
                    head = None
                if num_scheduled is None:  # it preempted itself: it was the last one
                    break
                budget -= num_scheduled
                index += 1
            elif head is not None:
                num_scheduled = self._admit(head, out, budget)
                if num_scheduled is None:  # the head of the line: nobody passes it
                    head = None
                    continue
                if head.status is RequestStatus.RUNNING:  # not pulling its KV
                    assert self.running[index] is head  # it came before running[index]
                    budget -= num_scheduled
                    index += 1
                skip.update(out.preempted_ids)  # its victims wait at least a step
                head = self._next_admissible(skip)
            else:
                break
        return out

    def _next_admissible(self, skip: set[str]) -> Request | None:
        """The first waiting request in order that is not waiting for another's pull.

        A pulled prompt whose next missing block some pull in flight is writing (the
        other choices of an ``n > 1`` request, a burst of requests sharing a system
        prompt) waits for that pull to land and then finds the blocks cached: it pulls
        only what differs, and shares the blocks instead of holding its own copy for its
        whole decode. Nobody waits behind it meanwhile: the line passes it. Without
        prefix caching nothing lands to share: each pulls its own at once (they pulled
        one after another, each still everything)."""
        waits = bool(self._pulling) and self.kv.enable_caching
        for request in self.waiting:
            if request.request_id in skip:
                continue
            if waits and self._waits_for_pull(request):
                skip.add(request.request_id)
                continue
            return request
        return None

    def _waits_for_pull(self, request: Request) -> bool:
        """Whether the first block of ``request`` not cached is one a pull is writing.
        The answer holds while that block is still being pulled (its cached run cannot
        grow past it before it lands), so it is looked up again only then: walking each
        waiting prompt's cached prefix every step cost 5 ms a step at 256 of them
        sharing a 192-block prompt, with no model time at all. (A run evicted meanwhile
        only makes it wait for that pull to land, then look again.)"""
        remote = request.remote_kv
        if remote is None or request.num_computed_tokens:
            return False
        index = request.waits_for_block
        if index is not None and request.block_hashes[index] in self._pulling:
            return True
        hits, _ = self.kv.get_computed_blocks(request)
        index = len(hits)
        waits = index < remote.num_tokens // self.block_size and (
            request.block_hashes[index] in self._pulling
        )
        request.waits_for_block = index if waits else None
        return waits

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """What a request computes this step from ``num_computed``: the rest of it, within
        ``prefill_chunk_tokens`` and ``budget``; 0 when images must be whole and the one
        it is at does not fit (``_whole_images``)."""
        num_new = request.num_tokens - num_computed
        if self.prefill_chunk_tokens is not None:
            num_new = min(num_new, self.prefill_chunk_tokens)
        boundary = self.kv.snapshot_boundary(request, num_computed)  # a hybrid model's states
        if num_computed < boundary < num_computed + num_new and not self.kv.has_snapshot(
            request, boundary
        ):
            num_new = boundary - num_computed
        return self._whole_images(request, num_computed, min(num_new, budget), budget)

    def _whole_images(self, request: Request, num_computed: int, num_new: int, budget: int) -> int:
        """``num_new`` cut before an image it would end inside, or grown to the image's
        end (past ``prefill_chunk_tokens``, within ``budget``) when it starts in or at one,
        where images' tokens attend to each other; else unchanged."""
        if not (self.whole_images and request.images):
            return num_new
        if num_computed >= request.images[-1].span.end:  # past its images (decoding)
            return num_new
        start = num_computed
        return whole_image_end(request.images, start, start + num_new, start + budget) - start

    def _schedule_running(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Schedule a running request's missing tokens (and drafts), preempting from the end
        of ``running`` for blocks. Returns the tokens scheduled; None if it preempted
        itself."""
        hits: list[KVBlock] = []
        prefilling = request.num_computed_tokens < request.num_tokens - 1
        if prefilling:  # blocks another request computed since: take them, or stop at them
            hits = self.kv.get_next_cached_blocks(request)
        num_hit_tokens = len(hits) * self.block_size
        num_new = self._num_new_tokens(request, request.num_computed_tokens + num_hit_tokens,
                                       budget)  # fmt: skip
        if prefilling and not hits:
            stop = self.kv.tokens_to_cached_block(request)
            if stop and stop < num_new:
                num_new = self._whole_images(request, request.num_computed_tokens, stop, budget)
        if num_new == 0:  # an image that does not fit this step's budget
            return 0
        assert num_new > 0
        drafts = self._drafts(request, budget)
        lookahead = self._lookahead(request, len(drafts))
        allocated = bool(drafts or lookahead) and self.kv.allocate_slots(
            request, num_new + len(drafts) + lookahead
        )
        if not allocated:
            drafts = []  # no room to guess: decode one token, preempting if need be
        # A victim's blocks among the hits stay cached once freed (only a later allocation
        # evicts them), and allocate_slots counts free hits against the free blocks.
        while not allocated and not self.kv.allocate_slots(request, num_new, hits):
            if self.kv.release_held_snapshots():  # a hybrid model's: before anyone goes
                continue
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return None
        if hits:
            request.num_computed_tokens += num_hit_tokens
            request.num_cached_tokens += num_hit_tokens
            self.kv.record_lookup(0, num_hit_tokens)  # queried at admission, missed then
        if drafts and self.draft_groups is not None:
            self.draft_groups.reserve(request.request_id)  # (its slots keep each token's states)
        out.scheduled.append(self._scheduled(request, num_new, drafts))
        return num_new + len(drafts)

    def _lookahead(self, request: Request, num_drafts: int) -> int:
        """Slots past a decoding request's tokens and drafts, for the drafting model's
        further drafts after this step (``engine/mtp_drafts.py``: they stop where the request's
        blocks end): ``draft_lookahead``, within what it may still generate.
        Taken only when the pool has room, never by preempting."""
        if not self.draft_lookahead or not request.may_speculate:
            return 0
        left = request.max_tokens - request.num_output_tokens - 1 - num_drafts
        return max(0, min(self.draft_lookahead, left))

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Tokens to verify after a decoding request's last one: at most what its draft
        budget allows (``engine/draft_budget.py``), what the step's token budget leaves,
        and one fewer than the tokens it may still generate (the step samples one more
        than it keeps)."""
        if self.proposer is None or not request.may_speculate:
            return []
        if self.draft_groups is not None and not self.draft_groups.can_verify(request.request_id):
            return []  # every group of draft state slots is held (a hybrid model's)
        if request.draft_budget is None:
            request.draft_budget = DraftBudget(self.num_speculative_tokens)
        max_drafts = min(
            request.draft_budget.take(),
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
        )
        if max_drafts <= 0:
            return []
        return self.proposer.propose(request, max_drafts)[:max_drafts]

    def _admit(self, request: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Admit the head of the waiting line: into ``running`` with its first tokens
        scheduled (returns how many), or into ``fetching`` with its pull ordered (returns
        0). When it finds no batch slot or no blocks, it preempts running requests of a
        strictly larger priority value, last first, until it fits; returns None (and
        preempts no one) when even all of them would not make room."""
        plan = self._plan(request, budget)
        if not plan.pull and plan.num_new == 0:  # its next image does not fit the budget
            return None
        checked = False
        # A state snapshot to start from is held first: no allocation may evict it.
        self.kv.hold_restore(request.request_id, plan.restore)
        while True:
            held = len(self.held) if self.on_blocks_freed is not None else 0
            has_slot = len(self.running) + len(self.fetching) + held < self.max_num_seqs
            cache = not plan.pull  # pulled blocks enter the prefix cache when they land
            if has_slot and self.kv.allocate_slots(request, plan.num_tokens, plan.hits, cache):
                if plan.pull:
                    return self._start_fetch(request, plan, out)
                return self._start_running(request, plan, out)
            if has_slot and self.kv.release_held_snapshots():  # then try again
                continue
            lower = [r for r in self.running if r.priority > request.priority]
            if not lower or (  # before the first preemption: would they all make room?
                not checked
                and not self.kv.fits_after_freeing(request, plan.num_tokens, plan.hits, lower)
            ):
                self.kv.release_restore(request.request_id)
                return None
            checked = True
            self._preempt(self.running.pop(), out)

    def _plan(self, request: Request, budget: int) -> _Admission:
        """What admitting ``request`` takes: its cached blocks (device hits, then CPU-tier
        blocks to load) and the tokens to allocate slots for after the hits."""
        remote = request.remote_kv
        if remote is not None and request.num_computed_tokens == 0:
            # (a hybrid model's states come with the pull: any KV hit serves)
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if num_hit_tokens >= remote.num_tokens:
                hits = hits[: remote.num_tokens // self.block_size]
                num_hit_tokens = len(hits) * self.block_size
            # Blocks offloaded here earlier come back from CPU memory, not the network.
            loaded = self.kv.get_secondary_hits(request, len(hits))
            loaded = loaded[: max(remote.num_tokens // self.block_size - len(hits), 0)]
            num_tokens = remote.num_tokens - num_hit_tokens
            return _Admission(hits, num_hit_tokens, [], loaded, num_tokens, pull=True)
        hits, num_hit_tokens, loaded, restore = [], 0, [], []
        if request.num_computed_tokens == 0:
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if self.kv.num_state_blocks:  # a hybrid model's: where its states are cached
                state_hit = self.kv.state_hit(request, hits)
                hits, loaded, restore = state_hit.hits, state_hit.loaded, state_hit.restore
                num_hit_tokens = len(hits) * self.block_size
            else:
                loaded = self.kv.get_secondary_hits(request, len(hits))
        num_loaded_tokens = len(loaded) * self.block_size
        num_computed = request.num_computed_tokens + num_hit_tokens + num_loaded_tokens
        num_new = self._num_new_tokens(request, num_computed, budget)
        num_tokens = num_loaded_tokens + num_new
        return _Admission(hits, num_hit_tokens, restore, loaded, num_tokens, pull=False,
                          num_new=num_new)  # fmt: skip

    def _start_running(self, request: Request, plan: _Admission, out: SchedulerOutput) -> int:
        """Move an admitted request (its slots allocated) into ``running``, order the loads
        of its CPU-tier blocks, and schedule its first tokens; returns how many."""
        num_loaded_tokens = len(plan.loaded) * self.block_size
        if request.num_cached_tokens < 0:  # its first admission, pulled or not
            self.kv.record_lookup(request.num_tokens, plan.num_hit_tokens, num_loaded_tokens)
        self.waiting.remove(request)
        self._order_loads(request.request_id, plan, out)
        num_cached_tokens = plan.num_hit_tokens + num_loaded_tokens
        request.num_computed_tokens += num_cached_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        if request.times.first_scheduled is None:
            request.times.first_scheduled = time.monotonic()
        self._add_running(request)
        scheduled = self._scheduled(request, plan.num_new)
        restore = self.kv.restoring.get(request.request_id)
        if restore:  # a snapshot cached on the device, or loaded from the CPU tier now
            scheduled.restore_block_ids = [block.block_id for block in restore]
            self.num_state_restores += 1
        out.scheduled.append(scheduled)
        return plan.num_new

    def _start_fetch(self, request: Request, plan: _Admission, out: SchedulerOutput) -> int:
        """Move an admitted remote prompt (its slots allocated, its new full blocks left out
        of the prefix cache) into ``fetching``: order the loads of the blocks the CPU tier
        holds and the pull of the rest not cached on the device. Returns 0 (no tokens)."""
        remote = request.remote_kv
        assert remote is not None
        num_loaded_tokens = len(plan.loaded) * self.block_size
        self.kv.record_lookup(request.num_tokens, plan.num_hit_tokens, num_loaded_tokens)
        self.waiting.remove(request)
        request.num_cached_tokens = plan.num_hit_tokens + num_loaded_tokens
        self.num_blocks_reused_for_remote += len(plan.hits) + len(plan.loaded)
        local_ids = self.kv.get_block_ids(request.request_id)
        self._order_loads(request.request_id, plan, out)
        first = len(plan.hits) + len(plan.loaded)
        last = cdiv(remote.num_tokens, self.block_size)
        # What lands on the device when the fetch ends, the CPU tier's loads too (they are
        # cached with the pulled blocks): a prompt sharing them waits for them, where it
        # waited only on pulled blocks and so loaded and pulled them all over again.
        landing = request.block_hashes[len(plan.hits) : remote.num_tokens // self.block_size]
        self._pulling.update(landing)
        self._pulled_hashes[request.request_id] = landing
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.times.fetch_started = time.monotonic()
        self.fetching[request.request_id] = request
        out.fetches.append(
            FetchOrder(
                request,
                remote_block_ids=list(remote.block_ids[first:last]),
                local_block_ids=local_ids[first:last],
                block_indices=list(range(first, last)),
            )
        )
        return 0

    def _order_loads(self, request_id: str, plan: _Admission, out: SchedulerOutput) -> None:
        """Load the CPU-tier blocks of an admission into the device blocks after its hits,
        and a hybrid model's state snapshot into the blocks taken for it, reserved so
        this step's flush cannot evict them."""
        block_ids = self.kv.block_ids_view(request_id)
        if plan.loaded:
            first = len(plan.hits)
            out.loads.append(LoadOrder(plan.loaded, block_ids[first : first + len(plan.loaded)]))
            self.kv.secondary.reserve(plan.loaded)
        snapshot = self.kv.take_snapshot_load(request_id)
        if snapshot is not None:  # a hybrid model's states, from the CPU tier too
            out.loads.append(LoadOrder(*snapshot))
            self.kv.secondary.reserve(snapshot[0])
            self.num_state_loads += 1

    def _add_running(self, request: Request) -> None:
        """Into ``running`` by ``running_order``: after every admitted request of its
        priority (under FCFS, appended)."""
        request.admission_seq = self._num_admissions
        self._num_admissions += 1
        bisect.insort(self.running, request, key=running_order)

    def finish_fetch(
        self, request_id: str, ok: bool, recompute_on_failure: bool = True, late: bool = False
    ) -> None:
        """The pull of ``request_id`` ended. On success the request continues from the end
        of its remote prompt; on failure it is prefilled locally (``recompute_on_failure``)
        or finishes aborted with an error. A ``late`` failure (its transport may still
        write the pulled blocks) quarantines them under the pull's transfer id first:
        the request lets them go, and ``release_quarantine`` frees them."""
        request = self.fetching.pop(request_id)
        request.times.fetch_finished = time.monotonic()
        self._pulling.subtract(self._pulled_hashes.pop(request_id))
        self._pulling = +self._pulling  # drop the zeros: an empty Counter means no pulls
        if late:
            assert not ok
            self._quarantine_pulled(request)
        if request.status is RequestStatus.FINISHED_ABORTED:  # aborted while pulling
            self._free_blocks(request)
            return
        remote = request.remote_kv
        assert remote is not None
        if ok:
            first = cdiv(request.num_cached_tokens, self.block_size)
            request.num_remote_blocks_pulled = cdiv(remote.num_tokens, self.block_size) - first
            request.num_computed_tokens = remote.num_tokens
            self.kv.cache_full_blocks(request, remote.num_tokens)
            # The KV is here now. Preempted later, the request recomputes it (its full
            # blocks may still be cached) and never pulls again: the router releases the
            # lease once decoding starts, and the peer may have reused those blocks.
            request.remote_kv = None
            # Straight to running: it holds blocks, and only running requests can be
            # preempted. Parked in ``waiting`` (as before) it could hold the very blocks
            # the head of the queue needs, and nothing would ever run again.
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
            self._add_running(request)
        elif recompute_on_failure:
            self._free_blocks(request)
            request.remote_kv = None
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.push(request)
        else:
            request.error = f"pulling the prompt's KV from {remote.transfer_id} failed"
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _quarantine_pulled(self, request: Request) -> None:
        """Quarantine the blocks the request's pull writes (after its hits and loads, up
        to its remote prompt's end) under the pull's transfer id."""
        remote = request.remote_kv
        assert remote is not None
        first = cdiv(request.num_cached_tokens, self.block_size)
        last = cdiv(remote.num_tokens, self.block_size)
        self.kv.quarantine(request.request_id, first, last, remote.transfer_id)

    def release_quarantine(self, transfer_id: str) -> int:
        """A late pull's write has ended: its quarantined blocks go back to the free pool.
        Returns how many (0 for an unknown transfer id)."""
        return self.kv.release_quarantine(transfer_id)

    def _free_blocks(self, request: Request) -> None:
        self.kv.free(request)
        if self.on_blocks_freed is not None:
            self.on_blocks_freed(request.request_id)

    def _scheduled(
        self, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        end = request.num_computed_tokens + num_new
        samples = end == request.num_tokens
        drafts = drafts or []
        scheduled = ScheduledRequest(request, num_new + len(drafts), samples, drafts)
        # A hybrid model's states are snapshotted where its step ends at a boundary...
        boundary = self.kv.snapshot_boundary(request, request.num_computed_tokens)
        if boundary and end == boundary and not self.kv.has_snapshot(request, boundary):
            scheduled.snapshot_block_ids = self.kv.take_snapshot_blocks(request, boundary)
        elif (  # and after what it generated: at each block boundary its decode reaches
            self.rolling_snapshots
            and samples
            and end % self.block_size == 0
            and not self.kv.has_snapshot(request, end)
        ):
            scheduled.snapshot_block_ids = self.kv.take_snapshot_blocks(request, end, True)
        return scheduled

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free a request taken out of ``running`` and put it back in line to recompute."""
        self._free_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # The draft model's KV goes with the blocks: how far it had read says nothing of
        # the blocks the re-admission takes (one taken fresh at a prefix hit's end held
        # a position it had read, and no lead read it again: ``_draft_lead``).
        request.draft_kv_end = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)
        out.preempted_ids.append(request.request_id)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, SampledTokens]
    ) -> list[tuple[Request, int]]:
        """Advance the scheduled requests by what the step computed and sampled. Returns the
        requests that produced tokens this step (finished ones included), each with how
        many it appended; an embedding request whose prompt is now computed finishes here
        (with 0 appended: its embedding is the engine's to set).

        A request that verified drafts sampled the drafts it kept and one token more; the
        KV of its last token and of the kept drafts is valid, the rest is not computed. The
        tokens are appended one at a time, each checked for a stop, so a stop among them
        ends the request there, as it would have one step at a time."""
        progressed = []
        now = time.monotonic()
        for item in out.scheduled:
            request = item.request
            if item.restore_block_ids is not None:  # copied into its slot: let go
                self.kv.release_restore(request.request_id)
            if item.snapshot_block_ids is not None:  # written: into the prefix cache
                self.kv.cache_snapshot(request.request_id)
            num_drafts = len(item.draft_token_ids)
            request.num_computed_tokens += item.num_scheduled_tokens - num_drafts
            if not item.samples:
                continue
            if request.pooling is not None:  # its prompt is computed: it is done
                request.times.first_token = now
                progressed.append((request, 0))
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                continue
            tokens = sampled[request.request_id]
            assert 1 <= len(tokens) <= num_drafts + 1
            request.num_computed_tokens += len(tokens) - 1  # the kept drafts
            if num_drafts:
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += len(tokens) - 1
                assert request.draft_budget is not None
                request.draft_budget.update(
                    num_drafts, len(tokens) - 1, self.num_speculative_tokens
                )
            if request.times.first_token is None:
                request.times.first_token = now
            status = None
            num_appended = 0
            for token_id, logprobs in tokens:
                request.append_output_token(token_id, logprobs)
                num_appended += 1
                status = request.check_stop()
                if status is not None:
                    break
            self.kv.update_block_hashes(request)
            progressed.append((request, num_appended))
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
        return progressed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.times.finished = time.monotonic()
        del self.requests[request.request_id]
        if status is RequestStatus.FINISHED_PREFILLED:
            self.held[request.request_id] = request
        else:
            self._free_blocks(request)

    def leak_report(self) -> list[str]:
        problems = [f"request {rid} still in the scheduler" for rid in self.requests]
        problems += [f"request {rid} still pulling KV" for rid in self.fetching]
        if self._pulling or self._pulled_hashes:
            problems.append(f"{len(self._pulling)} block hashes still marked as being pulled")
        problems += [f"request {rid} still holds KV for a decode worker" for rid in self.held]
        if self.waiting or self.running:
            problems.append(f"{len(self.waiting)} waiting, {len(self.running)} running")
        return problems + self.kv.leak_report()
