"""Continuous batching under a per-step token budget. FCFS, preemption by recompute.

Each step every running request gets the tokens it is missing (``num_tokens -
num_computed_tokens``: a whole or chunked prompt, or the one token it just sampled), in
arrival order, until the budget runs out; then waiting requests are admitted the same way.
A request that cannot get blocks preempts the most recently admitted running request,
which frees everything and later recomputes (mostly from the prefix cache).

Requests in ``WAITING_FOR_REMOTE_KV`` stay in the waiting queue without blocking the ones
behind them until their KV has landed (``finish_remote_kv``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.config import EngineConfig
from engine.block_pool import BlockPoolObserver
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, TokenLogprobs


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_scheduled_tokens: int
    # True when this step computes the request's last missing token, so the step's
    # sampled token extends it; false for a prompt chunk that is not the last.
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        observers: Iterable[BlockPoolObserver] = (),
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, observers
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests
        self.kv.update_block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        return out

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        if self.prefill_chunk_tokens is not None:
            num_new = min(num_new, self.prefill_chunk_tokens)
        return min(num_new, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            assert num_new > 0
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    return budget
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, samples)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, tuple[int, TokenLogprobs | None]],
    ) -> list[Request]:
        """Advance the scheduled requests by what the step computed and sampled. Returns the
        requests that produced a token this step (finished ones included)."""
        progressed = []
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_scheduled_tokens
            if not item.samples:
                continue
            token_id, logprobs = sampled[request.request_id]
            request.append_output_token(token_id, logprobs)
            self.kv.update_block_hashes(request)
            progressed.append(request)
            status = request.check_stop()
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
        return progressed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]

    def leak_report(self) -> list[str]:
        problems = [f"request {rid} still in the scheduler" for rid in self.requests]
        if self.waiting or self.running:
            problems.append(f"{len(self.waiting)} waiting, {len(self.running)} running")
        return problems + self.kv.leak_report()
