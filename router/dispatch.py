"""One sequence's journey through the workers, as a stream of token deltas.

    place ─► Prefill on a prefill worker ──► first token ─► Generate on a decode worker
      │        (other prefill workers on failure;             (pulls the KV, streams; other
      │         local prefill when none answers)               decode workers before the
      └────────────────────► Generate without KV (local prefill) ───── first byte only)

Retries happen only before the client saw anything from that hop. Cancelling the
iterator (the client went away) cancels the gRPC call in flight, which aborts the request
on the worker. A prefill lease is released as soon as the choice no longer needs it (the
decode side has the KV, or the client left, even while the Prefill reply was in flight);
it expires by itself only if that release is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.config import Role
from common.hashing import BlockHash
from common.intmath import cdiv
from common.router_config import RouterConfig
from proto import ADMITTED_KEY, PARAM_KEY, REFUSED_KEY
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.errors import APIError, bad_request, unavailable
from router.metrics import RouterMetrics
from router.policy import Placement, PlacementPolicy, WorkerLoad
from router.prefix_demand import PrefixDemand
from router.prefix_index import PrefixIndex
from router.workers import LoraRef, WorkerPool, WorkerStalled, WorkerState

logger = logging.getLogger(__name__)

PAST_DEADLINE = "the request ran past router.request_timeout_s; retry shortly"
# A call the router's own deadline ended may say so a little before its clock does.
_DEADLINE_SLACK_S = 0.1
_END_S = 2.0  # how long a finished decode call may take to end by itself
# How long a decode call whose client left mid-pull is read on for its first reply (the
# pull's end) before it is cancelled and the lease left to expire (``_settle_pull``).
_SETTLE_PULL_S = 30.0
_RETRYABLE = {
    grpc.StatusCode.ABORTED,  # a prefill released before its export (a decode's: _decode)
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True, slots=True)
class SequenceRequest:
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]
    sampling: pb.SamplingParams
    cache_salt: str | None = None
    lora: LoraRef | None = None  # a LoRA adapter the workers loaded; None: the base model
    priority: int = 0  # lower first, in the decode gate and both workers' engines
    # The request's trace context (``common/tracing.py``), sent as the calls' metadata.
    trace_headers: tuple[tuple[str, str], ...] = ()
    # A vision-language model's images, one per placeholder run (``router/images.py``).
    images: tuple[pb.Image, ...] = ()
    # A later sample of its prompt (n > 1): the first counted the prompt's use.
    sibling: bool = False


@dataclass(slots=True)
class TokenDelta:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    cached_tokens: int | None = None  # known before the end: on a choice's first delta
    # With sampling.prompt_logprobs, on a choice's first delta: prompt tokens 1.. scored.
    prompt_logprobs: list[pb.TokenLogprobs] | None = None


def _prompt_logprobs(request: SequenceRequest, scored) -> list[pb.TokenLogprobs] | None:
    """A reply's prompt scores, when the request asked for them."""
    return list(scored) if request.sampling.HasField("prompt_logprobs") else None


def _unscored(sampling: pb.SamplingParams) -> pb.SamplingParams:
    if not sampling.HasField("prompt_logprobs"):
        return sampling
    copy = pb.SamplingParams()
    copy.CopyFrom(sampling)
    copy.ClearField("prompt_logprobs")
    return copy


def _set_salt_and_adapter(
    message: pb.PrefillRequest | pb.GenerateRequest, request: SequenceRequest
) -> None:
    if request.cache_salt is not None:
        message.cache_salt = request.cache_salt
    if request.lora is not None:
        message.lora_name = request.lora.name
        message.lora_fingerprint = request.lora.fingerprint


def _generate_message(
    request: SequenceRequest,
    generated: list[int],
    kv: pb.KVHandle | None,
    lease: RemoteLease,
    first: pb.PrefillResponse | None,
    scores_prompt: bool,
) -> pb.GenerateRequest:
    """A decode try's call: the prompt, the tokens the client has (``generated``), and
    the prefill worker's KV handle while it may still be pulled, with the lease's time
    left as this host's monotonic clock says (hosts' wall clocks differ)."""
    message = pb.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=generated,
        sampling=request.sampling if scores_prompt else _unscored(request.sampling),
        priority=request.priority,
        images=request.images,
    )
    _set_salt_and_adapter(message, request)
    if kv is not None:
        message.kv.CopyFrom(kv)
        if lease.ends_by is not None:
            message.kv.lease_left_s = lease.ends_by - time.monotonic()
    if first is not None and len(generated) == 1:  # the prefill worker's MTP drafts
        message.draft_token_ids.extend(first.draft_token_ids)  # continue just that
    return message


def _nothing() -> None:
    """Nothing to end: no lease to release (the prompt was not prefilled elsewhere), or no
    placed worker to count a sequence on."""


@dataclass(slots=True)
class _Seat:
    """Where a sequence counts as ahead on a decode worker (``decode_gate.Ahead``) and how
    it leaves that count. It moves with the sequence: a retry or a migration that took it
    to another decode worker left it counted on the first (whose gate then held new
    sequences back from that idle worker, a restarted one kept it too) and not where it
    ran. ``worker_id`` None: no gate (``decode_queue_factor`` 0), nothing to move."""

    worker_id: str | None = None
    leave: Callable[[], None] = _nothing

    def move_to(self, worker: WorkerState, request: SequenceRequest, num_blocks: int) -> None:
        if self.worker_id is None or self.worker_id == worker.worker_id:
            return
        self.leave()  # (which wakes the old worker's line)
        left = worker.ahead.join(request.block_hashes, num_blocks, request.priority)

        def leave_and_wake() -> None:
            left()
            worker.gate.wake()

        self.worker_id, self.leave = worker.worker_id, leave_and_wake


class RemoteLease:
    """The router's side of a prefill worker's lease on a prompt's KV blocks: released
    early (``ReleaseKV``, fire and forget, once) when no decode worker can be reading
    them, or left to expire on the prefill worker where one may still be."""

    def __init__(self, release: Callable[[], None], ends_by: float | None = None) -> None:
        self._release: Callable[[], None] | None = release
        # The earliest the prefill worker's lease may end (``time.monotonic`` here: when
        # the Prefill call left, plus the worker's ``lease_ttl_s``); None: not said.
        self.ends_by = ends_by

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def leave_to_expire(self) -> None:
        self._release = None

    def hand_over(self) -> RemoteLease:
        """A lease that now holds this one's release (``_settle_pull``'s): this one's
        ``release`` does nothing any more, whoever calls it."""
        taken = RemoteLease(self._release or _nothing, self.ends_by)
        self._release = None
        return taken


def _pooled_rate(loads: list[WorkerLoad]) -> list[WorkerLoad]:
    """Every worker at the median measured prefill speed (identical hardware assumed)."""
    rates = sorted(load.prefill_tokens_per_s for load in loads if load.prefill_tokens_per_s)
    if not rates:
        return loads
    median = rates[len(rates) // 2]
    return [dataclasses.replace(load, prefill_tokens_per_s=median) for load in loads]


def cut_by_deadline(exc: grpc.aio.AioRpcError, deadline: float | None) -> bool:
    """Whether the sequence's own deadline (``time.monotonic``) ended the call: counted as
    a worker's failure, it blamed healthy workers for every request that timed out."""
    return (
        exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        and deadline is not None
        and time.monotonic() >= deadline - _DEADLINE_SLACK_S
    )


def _refused(exc: grpc.aio.AioRpcError) -> bool:
    """The worker turned the call away without starting it (``proto.REFUSED_KEY``)."""
    return any(key == REFUSED_KEY for key, _ in exc.trailing_metadata() or ())


def _draining(exc: grpc.aio.AioRpcError) -> bool:
    """It turned the call away as planned (draining, starting): no fault to alarm on.
    An engine that failed refuses too, and is one."""
    return any(key == REFUSED_KEY and value in ("draining", "starting")
               for key, value in exc.trailing_metadata() or ())  # fmt: skip


def _client_error(exc: grpc.aio.AioRpcError) -> APIError | None:
    """A worker's INVALID_ARGUMENT as a 400 naming the field it named (``PARAM_KEY``);
    its NOT_FOUND (the request's LoRA adapter, unloaded since the request was placed)
    as the 404 a request naming no such model gets: retrying elsewhere is no cure."""
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return APIError(404, exc.details() or "no such model", param="model",
                        code="model_not_found")  # fmt: skip
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    param = next((v for k, v in exc.trailing_metadata() or () if k == PARAM_KEY), None)
    return bad_request(exc.details() or "invalid request", param)


# How often a sequence waiting for room on a decode worker that went down is placed again.
_MAX_REPLACEMENTS = 3


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        index: PrefixIndex,
        index_lock: threading.Lock,
        policy: PlacementPolicy,
        metrics: RouterMetrics,
        block_size: int,
    ) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.index_lock = index_lock
        self.policy = policy
        self.metrics = metrics
        self.block_size = block_size
        # The matched prefixes' recent uses (under the index lock, as the index).
        self.demand = PrefixDemand(config.prefix_reuse_window_s)
        self._background: set[asyncio.Task] = set()
        self._last_expiry = 0.0

    # ------------------------------------------------------------------ placement

    def place(self, request: SequenceRequest) -> Placement:
        decode = self.pool.candidates(Role.DECODE, request.lora)
        if not decode:
            adapter = f" with LoRA adapter {request.lora.name!r}" if request.lora else ""
            raise unavailable(f"no decode worker{adapter} is available")
        prefill = self.pool.candidates(Role.PREFILL, request.lora)
        start = time.perf_counter()
        with self.index_lock:
            if start - self._last_expiry > 1.0:
                self.index.expire_optimistic()
                self._last_expiry = start
            ids = [w.worker_id for w in decode + prefill]
            # A prompt to score is computed whole wherever it goes (a cached block has no
            # logits): no worker saves it any work.
            reusable = [] if request.sampling.HasField("prompt_logprobs") else request.block_hashes
            matches = self.index.match(reusable, ids)
            held = reusable
            if self.policy.hybrid:  # the engine resumes before the last token's block ends
                held = reusable[: (len(request.prompt_token_ids) - 1) // self.block_size]
            confirmed = self.index.match(held, [w.worker_id for w in decode], optimistic=False)
            prefill_loads = [w.load() for w in prefill]
            if not self.config.per_worker_prefill_rate:
                prefill_loads = _pooled_rate(prefill_loads)
            # One use per prompt, not per sample: counted per sample, a prompt asked for
            # n=6 looked shared by 6 requests by its 6th sample, which then recomputed it
            # on an idle prefill worker (twice the work, for no later request's gain).
            uses = self.demand.use_deepest(reusable, matches.values(), not request.sibling)
            placement = self.policy.place(
                len(request.prompt_token_ids),
                [w.load() for w in decode],
                prefill_loads,
                matches,
                matches,
                confirmed,
                uses,
            )
            # Optimistic: the next request with this prefix should find it here.
            self.index.insert_optimistic(placement.decode_worker, request.block_hashes)
            if placement.prefill_worker:
                self.index.insert_optimistic(placement.prefill_worker, request.block_hashes)
        self.metrics.observe_placement(placement, time.perf_counter() - start)
        return placement

    def _moved(self, hashes: list[BlockHash], planned: str | None, actual: str | None) -> None:
        """The prompt's KV went to ``actual`` (None: nowhere), not to ``planned``: correct
        the optimistic entries ``place`` made. A worker that left meanwhile (this runs
        after the calls' awaits) is not claimed for: the index would keep its slot, freed
        only when it leaves, for good."""
        if planned == actual:
            return
        with self.index_lock:
            if planned is not None:
                self.index.withdraw_optimistic(planned, hashes)
            if actual is not None and self.pool.get(actual) is not None:
                self.index.insert_optimistic(actual, hashes)

    # ------------------------------------------------------------------ the journey

    async def generate(self, request: SequenceRequest) -> AsyncIterator[TokenDelta]:
        blocks = cdiv(len(request.prompt_token_ids), self.block_size)
        # One deadline for the whole sequence, from its admission: the wait for room on a
        # decode worker, every prefill try and every decode try share it.
        deadline = time.monotonic() + self.config.request_timeout_s
        placement = self.place(request)
        touched, decode, arrived = self._claim(placement, blocks)
        counted = False
        seat = _Seat()
        try:
            for attempt in range(_MAX_REPLACEMENTS + 1):
                if decode is None:
                    break
                try:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        room = await self._room_on(decode, request, blocks)
                except TimeoutError:
                    raise unavailable(
                        "the request waited router.request_timeout_s for room on a decode "
                        "worker; the service is overloaded, retry later"
                    ) from None
                if room is not None:
                    seat = _Seat(decode.worker_id if room is not _nothing else None, room)
                    break
                # Its decode worker went down, left or drains while it waited: placed
                # again, or refused, but never let past the line.
                arrived()
                self._withdraw(touched, request)
                if attempt == _MAX_REPLACEMENTS:
                    raise unavailable("decode workers kept going down while the request "
                                      "waited for room; retry shortly")  # fmt: skip
                placement = self.place(request)  # 503 when no decode worker is left
                touched, decode, arrived = self._claim(placement, blocks)
            # Closed with this generator (a stop string, a gone client), not when the
            # collector gets to it: its finally aborts the decode call and ends the lease.
            journey = self._journey(request, placement, touched, arrived, deadline, seat)
            async with contextlib.aclosing(journey):
                async for delta in journey:
                    if not counted and delta.cached_tokens is not None:
                        counted = True  # what the worker reused, not what placement expected
                        self.metrics.prefix_cache(
                            len(request.prompt_token_ids), delta.cached_tokens
                        )
                    yield delta
        except GeneratorExit:  # the consumer has what it needs (finished, a stop string)
            raise
        except BaseException:
            # Failed, refused or the client left: what the workers did store, their events
            # confirm; the claims ``place`` made go now instead of at their expiry.
            self._withdraw(touched, request)
            raise
        finally:
            arrived()
            seat.leave()

    def _claim(
        self, placement: Placement, num_blocks: int
    ) -> tuple[set[str], WorkerState | None, Callable[[], None]]:
        """The workers ``placement`` claimed prefix blocks on, its decode worker, and the
        call that ends the sequence's count there (``WorkerState.assign``)."""
        touched = {w for w in (placement.decode_worker, placement.prefill_worker) if w}
        decode = self.pool.get(placement.decode_worker)
        arrived = decode.assign(num_blocks) if decode is not None else _nothing
        return touched, decode, arrived

    def _withdraw(self, touched: set[str], request: SequenceRequest) -> None:
        """Drop the optimistic prefix claims ``place`` made for ``request`` there."""
        with self.index_lock:
            for worker_id in touched:
                self.index.withdraw_optimistic(worker_id, request.block_hashes)

    async def _journey(
        self,
        request: SequenceRequest,
        placement: Placement,
        touched: set[str],
        arrived: Callable[[], None],
        deadline: float,
        seat: _Seat | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """The sequence's hops. ``arrived`` ends its count as the placed decode worker's
        load once the decode hop takes over that count (its Generate call); ``seat``, its
        place among what is ahead there, moves with it."""
        first: pb.PrefillResponse | None = None
        lease = RemoteLease(_nothing)
        if placement.disaggregated:
            first, prefill_worker, sent_at = await self._prefill(request, placement, deadline)
            actual = prefill_worker.worker_id if prefill_worker is not None else None
            self._moved(request.block_hashes, placement.prefill_worker, actual)
            if actual is not None:
                touched.add(actual)
            if first is not None and prefill_worker is not None and first.kv.lease_id:
                ttl_s = first.kv.lease_ttl_s  # (0: a prefill worker from before)
                lease = self._lease(prefill_worker, first.kv.lease_id,
                                    sent_at + ttl_s if ttl_s else None)  # fmt: skip
        # However the choice ends (a client gone, a stop string on the first token, a decode
        # worker refusing it), the prefill worker's blocks are freed now, not at expiry,
        # unless a decode worker may still be reading them (``_decode``).
        try:
            if first is not None:
                delta = TokenDelta(
                    [first.first_token_id],
                    [first.first_logprobs] if first.HasField("first_logprobs") else [],
                    cached_tokens=first.num_cached_tokens,
                    prompt_logprobs=_prompt_logprobs(request, first.prompt_logprobs),
                )
                if first.finish_reason:  # no decode worker will hold this prompt
                    self._moved(request.block_hashes, placement.decode_worker, None)
                    delta.finish_reason = first.finish_reason  # with its token: a stop
                    delta.usage = pb.Usage(  # token's text is not shown
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=1,
                        cached_tokens=first.num_cached_tokens,
                    )
                    yield delta
                    return
                yield delta
            arrived()  # no await before _decode counts its call as the worker's running
            decode = self._decode(request, placement, first, lease, touched, deadline, seat)
            async with contextlib.aclosing(decode):  # (as ``generate`` closes this one)
                async for delta in decode:
                    yield delta
        finally:
            lease.release()

    async def _room_on(
        self, decode: WorkerState, request: SequenceRequest, num_blocks: int
    ) -> Callable[[], None] | None:
        """Backpressure (``router/decode_gate.py``): wait, in line with every sequence
        placed on ``decode`` (prefilled there or not), until this router's sequences ahead
        on ``decode`` (in prefill for it, in its queue or batch) number fewer than
        ``decode_queue_factor * max_num_seqs`` and, with this prompt's ``num_blocks``,
        take at most ``decode_queue_factor`` times its KV cache; the first one ahead goes
        whatever its size. A sequence with sequences of a larger priority value ahead
        (under priority scheduling) counts only those it cannot preempt: the decode
        engine makes room for it by preempting the others, which it never did while the
        sequence waited here (a priority-0 request waited for a priority-5 generation to
        end). Returns the call that ends this sequence's count, or None when ``decode``
        left the pool, is down or drains meanwhile (the caller places the sequence
        again)."""
        factor = self.config.decode_queue_factor
        if not factor:
            return _nothing
        max_seqs = factor * self.policy.max_running
        ahead = decode.ahead

        gone = [False]

        def has_room() -> bool:
            current = self.pool.get(decode.worker_id)
            if current is None or not current.available:
                gone[0] = True  # left, or down: place the sequence again instead
                return True
            if not ahead.num_seqs:
                return True
            blocking = ahead.num_seqs_not_after(request.priority)
            if blocking < ahead.num_seqs:  # some ahead the engine preempts for it
                return blocking < max_seqs
            max_blocks = factor * current.kv_blocks_total
            blocks = ahead.num_blocks_with(request.block_hashes, num_blocks)
            return ahead.num_seqs < max_seqs and (not max_blocks or blocks <= max_blocks)

        await decode.gate.enter(has_room, request.priority)
        if gone[0]:
            return None
        leave = ahead.join(request.block_hashes, num_blocks, request.priority)

        def leave_and_wake() -> None:
            leave()
            decode.gate.wake()  # (the gate is the worker id's, kept across restarts)

        return leave_and_wake

    async def _prefill(
        self, request: SequenceRequest, placement: Placement, deadline: float | None = None
    ) -> tuple[pb.PrefillResponse | None, WorkerState | None, float]:
        """First token and KV handle from a prefill worker, or (None, None, 0.0) to
        prefill locally on the decode worker, and when the answered call left (``time.monotonic``:
        the handle's lease is timed from then). Each try takes at most
        ``prefill_timeout_s`` and ends by the sequence's ``deadline``."""
        chosen = self.pool.get(placement.prefill_worker or "")
        others = [w for w in self.pool.candidates(Role.PREFILL, request.lora) if w is not chosen]
        others.sort(key=lambda w: w.queued_prefill_tokens)
        uncached = len(request.prompt_token_ids) - placement.prefill_cached_tokens
        message = pb.PrefillRequest(
            request_id=request.request_id,
            token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            priority=request.priority,
            images=request.images,
        )
        _set_salt_and_adapter(message, request)
        for worker in [w for w in [chosen, *others] if w is not None]:
            if self.pool.retired(worker):
                continue  # retired while an earlier try ran: its channel is closed
            if not worker.available or not worker.serves(request.lora):
                # Down, draining or without the adapter since placement: the sequence may
                # have waited seconds for room on its decode worker, or behind an earlier
                # try (a worker the pool saw freeze was called, and held the prefill).
                continue
            timeout = self.config.prefill_timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    break  # (the decode try then finds the deadline passed too)
            worker.queued_prefill_tokens += uncached  # taken back in the finally below
            sent_at = time.monotonic()
            call = worker.prefill.Prefill(message, timeout=timeout,
                                          metadata=request.trace_headers or None)  # fmt: skip
            try:
                with worker.tracking(call):
                    reply = await call
            except asyncio.CancelledError:
                # The client left. The reply, and a lease with it, may have landed or be in
                # flight: release whatever this request holds there (a no-op otherwise).
                self._release_kv(worker, pb.ReleaseKVRequest(request_id=request.request_id))
                raise
            except WorkerStalled:
                # The pool has marked it down; nothing was sent to the client. It may have
                # finished meanwhile: its lease would hold the blocks for lease_s.
                self._release_kv(worker, pb.ReleaseKVRequest(request_id=request.request_id))
                self.metrics.prefill_failures.inc()
                continue
            except grpc.aio.AioRpcError as exc:
                if cut_by_deadline(exc, deadline):  # the router's own: not the worker's fault
                    self._release_kv(worker, pb.ReleaseKVRequest(request_id=request.request_id))
                    return None, None, 0.0  # (the decode hop then finds the deadline passed)
                self.failed_call(worker, exc, f"prefill of {request.request_id}")
                # Past its deadline or cut off, it may have exported: free that now.
                self._release_kv(worker, pb.ReleaseKVRequest(request_id=request.request_id))
                if not _refused(exc):  # (a draining worker's refusal ran nothing)
                    self.metrics.prefill_failures.inc()
                continue
            finally:
                worker.queued_prefill_tokens -= uncached
                if not call.done():
                    call.cancel()
            self.metrics.observe_prefill(reply.timings)
            return reply, worker, sent_at
        self.metrics.prefill_fallbacks.inc()
        return None, None, 0.0

    def failed_call(self, worker: WorkerState, exc: grpc.aio.AioRpcError, what: str) -> None:
        """A unary call (a prefill; an embedding, ``router/embeddings.py``) to ``worker``
        failed: raises the client's 400 for invalid input, and ``exc`` where another
        worker would fail alike; else logs it and marks ``worker`` down where its being
        down is why (the caller goes on to the next worker)."""
        client_error = _client_error(exc)
        if client_error is not None:
            raise client_error from None
        if exc.code() not in _RETRYABLE:
            raise exc
        if _draining(exc):  # turned away unstarted, as planned: not a failure
            logger.info("%s on %s refused: %s", what, worker.worker_id, exc.details())
        else:
            logger.warning("%s on %s failed: %s", what, worker.worker_id, exc.details())
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
            self.pool.mark_unhealthy(worker.worker_id, draining=_draining(exc))

    def _next_decode_worker(
        self, preferred: str, tried: set[str], lora: LoraRef | None
    ) -> WorkerState | None:
        """The placement's worker first, then the least busy available one not yet tried.
        Asked afresh on every try (a worker that failed meanwhile is no longer available,
        one that joined is). A worker tried once is not tried again for this sequence,
        even restarted (its id stays): that bounds what one request can crash."""
        chosen = self.pool.get(preferred)
        if (
            chosen is not None
            and preferred not in tried
            and not self.pool.retired(chosen)
            and chosen.available
            and chosen.serves(lora)  # (unloaded meanwhile)
        ):  # one the pool saw die: no prefill pays for a try
            return chosen
        others = [w for w in self.pool.candidates(Role.DECODE, lora) if w.worker_id not in tried]
        return min(others, key=lambda w: w.num_running, default=None)

    async def _decode(
        self,
        request: SequenceRequest,
        placement: Placement,
        first: pb.PrefillResponse | None,
        lease: RemoteLease,
        touched: set[str],
        deadline: float | None = None,
        seat: _Seat | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the sequence from a decode worker, by ``deadline`` (``time.monotonic``;
        None: ``request_timeout_s`` from now). Before a worker's first response a
        failure tries the next one; after it (the client has its tokens) the sequence
        *migrates*: the next worker gets the prompt and every token sent so far, recomputes
        their KV and goes on, at most ``router.max_decode_migrations`` times. A move is
        charged when its worker is picked (a worker that crashes while recomputing counts)
        and refunded when that worker refused the call outright (draining: it never held
        the sequence). Sequences continue exactly as if nothing had failed, in float32:
        greedy ones, and sampled ones, which the router always seeds (seeded draws are
        keyed by output position)."""
        generated = [first.first_token_id] if first is not None else []  # the client has them
        kv = first.kv if first is not None else None
        cached_tokens = first.num_cached_tokens if first is not None else None
        if deadline is None:
            deadline = time.monotonic() + self.config.request_timeout_s
        migrations_left = self.config.max_decode_migrations
        streamed = False  # some decode worker has sent the client tokens
        failure: APIError | None = None  # what the client gets if no worker takes over
        tried: set[str] = set()
        holder: str | None = placement.decode_worker  # where the index expects the prompt
        while (
            worker := self._next_decode_worker(placement.decode_worker, tried, request.lora)
        ) is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            moving = streamed  # this try moves a sequence the client is reading
            if moving:
                if not migrations_left:
                    break
                migrations_left -= 1
                logger.warning("moving %s to %s after %d tokens", request.request_id,
                               worker.worker_id, len(generated))  # fmt: skip
            tried.add(worker.worker_id)
            if seat is not None:  # counted ahead where it runs
                seat.move_to(worker, request, cdiv(len(request.prompt_token_ids), self.block_size))
            self._moved(request.block_hashes, holder, worker.worker_id)
            holder = worker.worker_id
            touched.add(holder)
            # Only a local prefill scores the prompt: after a prefill worker's or an earlier
            # decode worker's first token the client has the prompt's log-probs.
            scores_prompt = kv is None and not generated
            message = _generate_message(request, generated, kv, lease, first, scores_prompt)
            started = timed = False
            num_tokens = len(request.prompt_token_ids) + len(generated)
            blocks = cdiv(num_tokens, self.block_size)
            worker.num_running += 1
            worker.kv_blocks_in_use += blocks
            metadata = request.trace_headers or None
            call = worker.decode.Generate(message, timeout=timeout, metadata=metadata)
            pulling = kv is not None  # until its first chunk, it may be reading the lease
            refused = finished = settling = False
            replies = aiter(call)
            try:
                with worker.tracking(call):
                    while True:
                        if pulling:
                            read = asyncio.ensure_future(anext(replies, None))
                            try:
                                chunk = await asyncio.shield(read)
                            except asyncio.CancelledError:
                                task = asyncio.current_task()
                                if task is not None and task.cancelling() and not read.done():
                                    settling = True  # the client left: the read goes on
                                    settled = lease.hand_over()
                                    self._in_background(self._settle_pull(read, call, settled))
                                raise
                        else:
                            chunk = await anext(replies, None)
                        if chunk is None:
                            break
                        first_chunk = not started
                        if first_chunk:  # the decode worker has the KV: free the prefill copy
                            started = streamed = True
                            pulling = False
                            lease.release()
                            if moving:
                                self.metrics.decode_migrations.inc()
                        generated.extend(chunk.token_ids)
                        num_tokens += len(chunk.token_ids)
                        grown = cdiv(num_tokens, self.block_size) - blocks
                        worker.kv_blocks_in_use += grown
                        blocks += grown
                        delta = TokenDelta(list(chunk.token_ids), list(chunk.logprobs))
                        if scores_prompt and first_chunk:
                            delta.prompt_logprobs = _prompt_logprobs(request, chunk.prompt_logprobs)
                        # Said with the first reply now; decode workers from before, with
                        # the last only: the first that says them, once.
                        if not timed and chunk.HasField("timings"):
                            timed = True
                            self.metrics.observe_decode(
                                chunk.timings, chunk.num_blocks_pulled, prefilled_here=scores_prompt
                            )
                        if cached_tokens is None and chunk.HasField("usage"):
                            cached_tokens = chunk.usage.cached_tokens  # prefilled there
                        delta.cached_tokens = cached_tokens
                        if chunk.finish_reason:
                            delta.finish_reason = chunk.finish_reason
                            delta.usage = chunk.usage
                            # What the client's prompt cost where it was first computed,
                            # not what a migration's recompute found cached.
                            delta.usage.cached_tokens = cached_tokens or 0
                            finished = True
                        yield delta
                return
            except WorkerStalled:
                self.metrics.decode_failures.inc()
                failure = unavailable("the decode worker stopped responding")
            except grpc.aio.AioRpcError as exc:
                failure = self._decode_failed(exc, request, worker, deadline)
                refused = _refused(exc)
                if moving and refused:
                    migrations_left += 1  # it never held the sequence
            finally:
                worker.num_running -= 1
                worker.kv_blocks_in_use -= blocks
                if not call.done() and not settling:
                    if finished:  # its status is on its way: a cancel marked it cancelled
                        self._let_end(call)
                    else:
                        call.cancel()
                if pulling and not refused and not settling:
                    # Cut off (the client left, the worker failed or stalled) while it may
                    # be reading the prefill worker's blocks: freed now, they could be
                    # reused and overwritten under a READ that then completes, and the
                    # decode worker would cache what it read under this prompt's hashes.
                    # The lease outlives the pull's deadline (kv_transfer.timeout_s <
                    # lease_s): the prefill worker frees them when it expires.
                    lease.leave_to_expire()
            if kv is not None and not refused:  # (a refusal never pulled: the next may)
                # The worker that failed may have pulled and then aborted, which releases
                # the lease: another pull could read reused blocks. Recompute instead.
                kv = None
                lease.release()
        lease.release()
        self._moved(request.block_hashes, holder, None)
        if streamed and failure is not None:
            raise failure
        if time.monotonic() >= deadline:
            raise unavailable(PAST_DEADLINE)
        raise unavailable("no decode worker could serve the request; retry shortly")

    def _decode_failed(
        self,
        exc: grpc.aio.AioRpcError,
        request: SequenceRequest,
        worker: WorkerState,
        deadline: float,
    ) -> APIError:
        """What the client gets for ``exc`` from a decode try if no other worker takes
        over; raised at once where no other try may (the client's own error, the
        deadline, a pull ``failure_policy: fail`` gave up, a status retrying cannot
        help). Logs it, counts it and marks the worker down as the status says."""
        client_error = _client_error(exc)
        if client_error is not None:
            raise client_error from None
        if cut_by_deadline(exc, deadline):  # not the worker's failure: no retry
            raise unavailable(PAST_DEADLINE) from None
        log = logger.info if _draining(exc) else logger.warning  # (a drain: planned)
        log("decode of %s on %s failed: %s %s", request.request_id, worker.worker_id,
            exc.code().name, exc.details())  # fmt: skip
        # Details stay in the log: they name hosts and internals.
        if exc.code() == grpc.StatusCode.ABORTED:
            # It gave the request up (its pull failed under failure_policy: fail): the
            # worker is well, and recomputing elsewhere is what `fail` declines.
            self.metrics.decode_failures.inc()
            raise unavailable(
                "moving the prompt's KV to the decode worker failed; retry the request"
            ) from None
        failure = unavailable("the decode worker failed; retry the request")
        if exc.code() not in _RETRYABLE:
            raise failure from None
        if not _refused(exc):  # a draining worker's refusal is no failed hop (drain alerts)
            self.metrics.decode_failures.inc()
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
            self.pool.mark_unhealthy(worker.worker_id, _draining(exc))
        return failure

    def _lease(self, worker: WorkerState, lease_id: str, ends_by: float | None) -> RemoteLease:
        """``lease_id`` on the prefill ``worker``, released by ``ReleaseKV``."""
        message = pb.ReleaseKVRequest(lease_id=lease_id)
        return RemoteLease(lambda: self._release_kv(worker, message), ends_by)

    def _release_kv(self, worker: WorkerState, message: pb.ReleaseKVRequest) -> None:
        """Fire and forget ``ReleaseKV``: if it fails, the lease just expires."""

        async def release() -> None:
            stub, channel = worker.prefill, None
            if self.pool.retired(worker):  # its channel is closing: a fresh one
                channel = self.pool.auth.aio_channel(worker.info.grpc_address)
                stub = pb_grpc.PrefillServiceStub(channel)
            try:
                with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                    await stub.ReleaseKV(message, timeout=5)
            finally:
                if channel is not None:
                    await channel.close()

        self._in_background(release())

    def _let_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Let a decode call whose last reply came end by itself (its status follows at
        once), cancelling it only if it does not within ``_END_S``: cancelled, the
        worker saw a finished request's call cancelled, and its span said so."""

        async def end() -> None:
            try:
                await asyncio.wait_for(call.code(), _END_S)
            except (TimeoutError, grpc.aio.AioRpcError):
                call.cancel()

        self._in_background(end())

    async def _settle_pull(
        self, read: asyncio.Future, call: grpc.aio.UnaryStreamCall, lease: RemoteLease
    ) -> None:
        """A decode call whose client left before its first reply, while the decode
        worker may be pulling the lease: read on until its engine holds the request
        (``ADMITTED_KEY``: cancelled, it frees the lease itself) or, from a worker that
        does not say so, until the first reply (the KV is there: the lease is released
        here), then cancel it. Cancelled at once, the call often ended before the decode
        worker had admitted it, so no one released the lease: it held the prefill
        worker's blocks for ``lease_s`` (an audit: three clients that left after their
        first streamed token held 114 of 128 blocks, and the next request's first token
        took 29.6 s). Read on for the first reply alone, a request queued behind a full
        decode batch held the lease, and then a slot, a pull and a step, for nothing."""
        # Its outcome is read even when nobody awaits it (no "never retrieved" log).
        read.add_done_callback(lambda done: done.cancelled() or done.exception())
        reply = None
        try:
            async with asyncio.timeout(_SETTLE_PULL_S):
                metadata = await call.initial_metadata()
                if not any(key == ADMITTED_KEY for key, _ in metadata or ()):
                    reply = await read  # (its headers came with its first reply)
        except (TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        if reply is not None:
            lease.release()  # the pull is over
        else:  # its engine frees the lease, or the lease expires: it may be reading
            lease.leave_to_expire()
        read.cancel()
        call.cancel()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
