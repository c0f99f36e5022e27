"""``/v1/embeddings`` behind the route: each input's ``Embed`` call, and OpenAI's response.

Every input is one engine request, placed and run on its own (``embed``) and batched
there with whatever the worker runs; the reply waits for all of them. One that fails
fails the request, and the rest are cancelled (which aborts them on the workers).

A request has at most ``LANES`` of its inputs' calls in flight at once, and takes that
many of the router's in-flight sequences, not one per input. A probe of 1,024-input
requests, each call sent at once, found every other client refused (429) for the 48 s
one ran, calls timing out in the workers' queues (the deadline counts the wait) and
retried elsewhere under the same deadline, and gRPC cancelling some of 1,300+
concurrent calls on one worker. 64 calls keep a worker's batch (``max_num_seqs``, 64 by
default) full.

Vectors travel from the workers as float32 bytes. As base64 (the OpenAI client's default)
they go out as they came. As JSON numbers they cost: 2,048 vectors of 4,096 took 4.3 s to
encode, which on the event loop would stall every stream the router serves. So a large
body is encoded and sent a piece at a time, the loop free between pieces.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import grpc
import numpy as np

from common.config import Role
from common.hashing import hash_blocks, prefix_salt
from common.intmath import cdiv
from proto import pdserve_pb2 as pb
from router.choices import hashing
from router.dispatch import PAST_DEADLINE, Dispatcher, SequenceRequest, cut_by_deadline
from router.errors import APIError, unavailable
from router.workers import LoraRef, WorkerStalled, WorkerState

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Floats encoded between two turns of the event loop (~4 ms of json.dumps).
PIECE_FLOATS = 1 << 15
LANES = 64  # a request's embedding calls in flight at once


class PooledBody(Protocol):
    """What ``embed_all`` reads of a request body (embeddings', score's, rerank's)."""

    cache_salt: str | None
    priority: int


async def embed(
    dispatcher: Dispatcher,
    request: SequenceRequest,
    normalize: bool,
    logit_token_ids: Sequence[int] = (),
    deadline: float | None = None,
) -> pb.EmbedResponse:
    """One input's embedding (``Embed``, which both roles answer). Placed as a
    generation's prompt would be: where its prefix is cached, and past
    ``min_disagg_tokens`` on a prefill worker. On a failure another worker might not have,
    it goes to the next worker that serves it (the other prefill workers, least queued
    first, then the decode workers, least busy first): an embedding shows the client
    nothing until it is done, so trying again is always safe. Counted as a sequence is
    (``vllm:request_success``, ``vllm:prompt_tokens``: vLLM counts pooling alike).
    ``logit_token_ids``: the last token's logits at these ids instead (a reranker's)."""
    message = pb.EmbedRequest(
        request_id=request.request_id,
        token_ids=request.prompt_token_ids,
        priority=request.priority,
        normalize=normalize,
        logit_token_ids=logit_token_ids,
    )
    if request.cache_salt is not None:
        message.cache_salt = request.cache_salt
    if request.lora is not None:
        message.lora_name = request.lora.name
        message.lora_fingerprint = request.lora.fingerprint
    metrics = dispatcher.metrics
    touched: set[str] = set()
    ran_on: str | None = None
    ended = "abort"
    # Every try ends by the request's ``deadline`` (``time.monotonic``; None:
    # request_timeout_s from now), as a generation's: with a full prefill_timeout_s each,
    # 4 frozen workers took 20 s past a request_timeout_s of 2.
    if deadline is None:
        deadline = time.monotonic() + dispatcher.config.request_timeout_s
    try:
        placement = dispatcher.place(request)
        touched = {w for w in (placement.decode_worker, placement.prefill_worker) if w}
        planned = placement.prefill_worker or placement.decode_worker
        for worker in _workers_to_try(dispatcher, planned, request.lora):
            if time.monotonic() >= deadline:
                raise unavailable(PAST_DEADLINE)
            reply = await _embed_on(dispatcher, worker, message, deadline, request.trace_headers)
            if reply is not None:
                ran_on, ended = worker.worker_id, "stop"
                num_tokens = len(request.prompt_token_ids)
                metrics.prefix_cache(num_tokens, reply.num_cached_tokens)
                metrics.prompt_tokens.inc(num_tokens)
                metrics.observe_prefill(reply.timings)  # prompt work, as a prefill's
                return reply
        if time.monotonic() >= deadline:  # (the last try was cut by it)
            raise unavailable(PAST_DEADLINE)
        raise unavailable("no worker could compute the embedding; retry shortly")
    except Exception:
        ended = "error"
        raise
    finally:  # the prompt's blocks are cached where it ran, and nowhere else it was placed
        metrics.sequence_ended(ended)
        with dispatcher.index_lock:
            for worker_id in touched - {ran_on}:
                dispatcher.index.withdraw_optimistic(worker_id, request.block_hashes)
            if ran_on is not None and ran_on not in touched and dispatcher.pool.get(ran_on):
                # (not for a worker that left meanwhile: its slot in the index would stay)
                dispatcher.index.insert_optimistic(ran_on, request.block_hashes)


def _workers_to_try(
    dispatcher: Dispatcher, planned: str, lora: LoraRef | None
) -> list[WorkerState]:
    """The planned worker, then the other prefill workers (least queued first), then the
    decode workers (least busy first)."""
    pool = dispatcher.pool
    chosen = pool.get(planned)
    prefill = sorted(pool.candidates(Role.PREFILL, lora), key=lambda w: w.queued_prefill_tokens)
    decode = sorted(pool.candidates(Role.DECODE, lora), key=lambda w: w.load().num_running)
    rest = [w for w in prefill + decode if w is not chosen]
    return rest if chosen is None else [chosen, *rest]


async def _embed_on(
    dispatcher: Dispatcher,
    worker: WorkerState,
    message: pb.EmbedRequest,
    deadline: float,
    trace_headers: tuple[tuple[str, str], ...] = (),
) -> pb.EmbedResponse | None:
    """The reply, or None when ``worker`` failed in a way another may not (marked down
    where its being down is why). Invalid input is the client's 400. While the call runs
    it counts in the worker's load as placement reads it: queued prompt tokens on a
    prefill worker, a sequence and its blocks on a decode worker."""
    if dispatcher.pool.retired(worker):
        return None  # retired while an earlier try ran: its channel is closed
    num_tokens = len(message.token_ids)
    done: Callable[[], None]
    if worker.info.role is Role.DECODE:
        done = worker.assign(cdiv(num_tokens, dispatcher.block_size))
    else:
        worker.queued_prefill_tokens += num_tokens

        def done() -> None:
            worker.queued_prefill_tokens -= num_tokens

    timeout_s = min(dispatcher.config.prefill_timeout_s, deadline - time.monotonic())
    call = worker.stub.Embed(message, timeout=timeout_s,
                             metadata=trace_headers or None)  # fmt: skip
    try:
        with worker.tracking(call):
            return await call
    except WorkerStalled:
        return None  # the pool has marked it down
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a worker older than Embed (an
            logger.warning("%s has no Embed; trying another", worker.worker_id)  # upgrade)
            return None
        if cut_by_deadline(exc, deadline):  # the router's own: not the worker's fault
            return None  # (the next try finds the deadline passed)
        dispatcher.failed_call(worker, exc, f"embedding of {message.request_id}")
        return None
    finally:
        done()
        if not call.done():
            call.cancel()


async def embed_all(
    dispatcher: Dispatcher,
    prompts: list[list[int]],
    response_id: str,
    block_size: int,
    lora: LoraRef | None,
    body: PooledBody,
    lanes: int,
    *,
    normalize: bool,
    logit_token_ids: Sequence[int] = (),
    trace_headers: tuple[tuple[str, str], ...] = (),
) -> list[pb.EmbedResponse]:
    """Every prompt's embedding (or logits at ``logit_token_ids``), all or none
    (``all_or_none``), with at most ``lanes`` calls in flight; prompt ``i`` runs as request
    ``<response_id>-<i>``. ``trace_headers``: the trace context the calls carry."""
    salt = prefix_salt(body.cache_salt, lora and lora.key)

    def build() -> list[SequenceRequest]:
        # Nothing to sample: placement reads of the sampling only whether it scores a prompt.
        return [
            SequenceRequest(f"{response_id}-{index}", tokens, hash_blocks(tokens, block_size,
                            salt), pb.SamplingParams(), body.cache_salt, lora, body.priority,
                            trace_headers)
            for index, tokens in enumerate(prompts)
        ]  # fmt: skip

    deadline = time.monotonic() + dispatcher.config.request_timeout_s  # (all inputs')
    sequences = await hashing(prompts, build)
    replies = [pb.EmbedResponse()] * len(sequences)  # each lane fills its inputs' places
    next_index = 0

    async def lane() -> None:  # takes the next input until none is left
        nonlocal next_index
        while next_index < len(sequences):
            index, next_index = next_index, next_index + 1
            replies[index] = await embed(dispatcher, sequences[index], normalize,
                                         logit_token_ids, deadline)  # fmt: skip

    await all_or_none([lane() for _ in range(min(lanes, len(sequences)))])
    return replies


async def all_or_none(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every call's result in order; when one raises (or this is cancelled), the others
    are cancelled and awaited before the error goes on, so none runs on unseen."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_finite(vectors: Sequence[bytes], what: str) -> None:
    """A 500 naming the cause when a vector (float32 bytes) holds NaN or an infinity (a
    model overflowing in float16, say): JSON has no such numbers, and the document came
    out invalid, or Starlette refused it with an anonymous 500 mid-way."""
    if not all(np.isfinite(np.frombuffer(raw, dtype="<f4")).all() for raw in vectors):
        raise APIError(
            500,
            f"the model computed {what} that hold NaN or infinite values, which JSON "
            "cannot carry (an overflow in the model's dtype?)",
            "internal_error",
            None,
            "non_finite_output",
        )


def encoded(raw: bytes, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of float32 little-endian
    bytes (what the OpenAI Python client asks for by default and decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return np.frombuffer(raw, dtype="<f4").tolist()


class EmbeddingsBody:
    """The response document, whole (``whole``) or in pieces (``pieces``)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        replies: Sequence[pb.EmbedResponse],
        num_prompt_tokens: int,
        encoding_format: str,
    ) -> None:
        self.replies = replies
        self.encoding_format = encoding_format
        head = {"id": response_id, "object": "list", "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}
        self.head = json.dumps(head)[:-1].encode() + b', "data": ['
        self.tail = b'], "usage": ' + json.dumps(usage).encode() + b"}"
        self.num_floats = sum(len(reply.embedding) for reply in replies) // 4

    @property
    def small(self) -> bool:
        """Cheap to encode at once: base64, or few enough numbers."""
        return self.encoding_format == "base64" or self.num_floats <= PIECE_FLOATS

    def _items(self, start: int, stop: int) -> bytes:
        return b", ".join(
            json.dumps({"object": "embedding", "index": index,
                        "embedding": encoded(self.replies[index].embedding,
                                             self.encoding_format)}).encode()
            for index in range(start, stop)
        )  # fmt: skip

    def whole(self) -> bytes:
        return self.head + self._items(0, len(self.replies)) + self.tail

    async def pieces(self) -> AsyncIterator[bytes]:
        yield self.head
        index, per_piece = 0, max(1, PIECE_FLOATS * 4 // max(len(self.replies[0].embedding), 1))
        while index < len(self.replies):
            stop = min(index + per_piece, len(self.replies))
            yield (b", " if index else b"") + self._items(index, stop)
            index = stop
            await asyncio.sleep(0)  # other requests run between pieces
        yield self.tail
