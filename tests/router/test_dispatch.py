"""The dispatcher's decode retry: a second decode worker gets the request without the KV
handle (it recomputes the prompt), since the first may have released the lease by aborting
its pull; the lease's early release only where no decode worker can be reading it; and
its migration of a sequence whose decode worker failed mid-stream."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.config import Role
from common.hashing import hash_blocks
from common.kv_events import BlockStored, StateStored
from common.registry import RedisRegistry, WorkerInfo
from common.router_config import RouterConfig
from engine.errors import UnknownLoraAdapterError
from proto import ADMITTED_KEY, PARAM_KEY
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.dispatch import Dispatcher, RemoteLease, SequenceRequest, _nothing, _Seat
from router.embeddings import embed, embed_all
from router.errors import APIError
from router.events import EventListener
from router.metrics import RouterMetrics
from router.policy import Placement, PlacementPolicy
from router.pooling_protocol import EmbeddingRequest
from router.prefix_index import PrefixIndex
from router.workers import LoraRef, WorkerPool
from tests.common.redis_server import run_with_registry
from worker.grpc_errors import DrainingError, RequestFailedError, grpc_errors, grpc_stream_errors


class Decode(pb_grpc.DecodeServiceServicer):
    """Streams ``token_ids`` one per chunk, then fails (as a worker whose engine failed
    answers) or finishes with 42."""

    def __init__(self, fail: bool, token_ids: tuple[int, ...] = (), old: bool = False) -> None:
        """``old``: as a build from before the first reply said the timings."""
        self.fail = fail
        self.token_ids = token_ids
        self.old = old
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        timings = pb.StageTimings(queue_ms=5, prefill_ms=7)  # with the first reply, and last
        for i, token_id in enumerate(self.token_ids):
            reply = pb.GenerateResponse(token_ids=[token_id], usage=pb.Usage(cached_tokens=3))
            if i == 0 and not self.old:
                reply.timings.CopyFrom(timings)
                if request.sampling.HasField("prompt_logprobs"):  # a local prefill
                    reply.prompt_logprobs.extend(scores(request.prompt_token_ids))
            yield reply
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine failed")
        yield pb.GenerateResponse(token_ids=[42], finish_reason="length", usage=pb.Usage(),
                                  timings=timings)  # fmt: skip

    async def Stats(self, request, context):
        return pb.StatsResponse()


def scores(prompt_token_ids) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token_id=t, logprob=-t / 100) for t in prompt_token_ids[1:]]


class Draining(Decode):
    """Turns every call away as a draining worker does (the real error mapping)."""

    def __init__(self, reason: str = "draining") -> None:
        super().__init__(fail=True)
        self.reason = reason

    @grpc_stream_errors
    async def Generate(self, request, context):
        self.requests.append(request)
        raise DrainingError("decode@test", self.reason)
        yield  # an async generator, like the real method


class HeldPrefill(pb_grpc.PrefillServiceServicer):
    """Answers every prompt (first token 7, a lease) once ``go`` is set; counts the calls."""

    def __init__(self, lease_ttl_s: float = 0.0) -> None:
        self.go = asyncio.Event()
        self.num_calls = 0
        self.lease_ttl_s = lease_ttl_s  # (0: not said, as a worker from before)

    async def Prefill(self, request, context):
        self.num_calls += 1
        await self.go.wait()
        reply = pb.PrefillResponse(first_token_id=7)
        reply.kv.lease_id = f"lease-{request.request_id}"
        reply.kv.num_tokens = len(request.token_ids)
        reply.kv.lease_ttl_s = self.lease_ttl_s
        return reply

    async def ReleaseKV(self, request, context):
        return pb.ReleaseKVResponse(released=True)

    async def Stats(self, request, context):
        return pb.StatsResponse()


async def serve(
    servicer: Decode | HeldPrefill, registry: RedisRegistry, kv_blocks_total: int = 0
) -> tuple[grpc.aio.Server, WorkerInfo]:
    """A decode (or prefill) service on a free port of 127.0.0.1, registered."""
    server = grpc.aio.server()
    role = Role.PREFILL if isinstance(servicer, HeldPrefill) else Role.DECODE
    if role is Role.PREFILL:
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    else:
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    info = WorkerInfo(
        worker_id=f"{role}@127.0.0.1:{port}", role=role,
        grpc_address=f"127.0.0.1:{port}", events_endpoint="tcp://127.0.0.1:1",
        replay_endpoint="tcp://127.0.0.1:2", kv_blocks_total=kv_blocks_total,
    )  # fmt: skip
    registry.register(info)
    return server, info


async def refreshed(pool: WorkerPool, timeout_s: float = 10.0) -> None:
    """``pool.refresh()``, again until every registered worker has answered a probe (or
    ``timeout_s``). A probe gets 1 s; the first call on a new channel missed it on a
    loaded 2-core CI run, and the test found no candidate."""
    deadline = time.monotonic() + timeout_s
    await pool.refresh()
    while not all(state.ever_answered for state in pool.workers.values()):
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)
        await pool.refresh()


def pool_and_dispatcher(
    registry: RedisRegistry,
    index: PrefixIndex,
    config: RouterConfig | None = None,
    hybrid: bool = False,
) -> tuple[WorkerPool, Dispatcher]:
    lock = threading.Lock()
    pool = WorkerPool(registry, EventListener(index, lock), 60.0, 30.0)
    config = config or RouterConfig()
    policy = PlacementPolicy(config, 16, 8, hybrid=hybrid)
    return pool, Dispatcher(config, pool, index, lock, policy, RouterMetrics("m"), 16)


@pytest.mark.timeout(60)
def test_a_retried_decode_recomputes_instead_of_pulling_again(tmp_path):
    failing, healthy = Decode(fail=True), Decode(fail=False)

    async def scenario(registry: RedisRegistry) -> list[int]:
        servers = [await serve(failing, registry), await serve(healthy, registry)]
        ids = [info.worker_id for _, info in servers]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        released: list[bool] = []
        try:
            await refreshed(pool)
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams())
            first = pb.PrefillResponse(first_token_id=7)
            first.kv.lease_id = "lease-1"
            first.kv.num_tokens = 35
            placement = Placement(ids[0], "prefill@x", 0, 0)
            tokens = []
            lease = RemoteLease(lambda: released.append(True))
            async for delta in dispatcher._decode(request, placement, first, lease, set()):
                tokens += delta.token_ids
            # The first worker failed before its first chunk, maybe mid-pull: the lease is
            # left to expire on the prefill worker, after the pull's deadline.
            lease.release()
            assert not released
            return tokens
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [42]
    assert failing.requests[0].HasField("kv")  # the first try pulls
    retried = healthy.requests[0]
    assert not retried.HasField("kv") and list(retried.output_token_ids) == [7]


@pytest.mark.timeout(60)
def test_both_calls_name_the_adapters_files_they_were_placed_for(tmp_path):
    """A worker that has other files under the adapter's name now (reloaded meanwhile)
    refuses the request instead of decoding KV computed with the old ones."""
    decode = Decode(fail=False)
    adapters = [pb.LoraAdapterInfo(name="alice", fingerprint="fp-1")]

    async def stats(request, context):
        return pb.StatsResponse(lora_adapters=adapters)

    decode.Stats = stats  # it serves the adapter
    prefill = LatePrefill()
    prefill.go.set()
    prefill.Stats = stats
    requests: list[pb.PrefillRequest] = []
    answer = prefill.Prefill

    async def recording(request, context):
        requests.append(request)
        return await answer(request, context)

    prefill.Prefill = recording

    async def scenario(registry: RedisRegistry) -> None:
        (server_p, info_p), (server_d, info_d) = await serve(prefill, registry), await serve(
            decode, registry)  # fmt: skip
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            lora = LoraRef("alice", "fp-1")
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams(),
                                      lora=lora)  # fmt: skip
            placement = Placement(info_d.worker_id, info_p.worker_id, 0, 0)
            first, _, _ = await dispatcher._prefill(request, placement)
            lease = RemoteLease(lambda: None)
            async for _ in dispatcher._decode(request, placement, first, lease, set()):
                pass
        finally:
            await pool.close()
            await server_p.stop(None)
            await server_d.stop(None)

    run_with_registry(tmp_path, scenario)
    (prefilled,) = requests
    (generated,) = decode.requests
    for message in (prefilled, generated):
        assert (message.lora_name, message.lora_fingerprint) == ("alice", "fp-1")


class UnloadedAdapter(Decode):
    """Serves ``alice`` by its Stats, but its engine no longer has it (unloaded through
    another router after the request was placed): refuses both calls through the real
    error mapping."""

    async def Stats(self, request, context):
        return pb.StatsResponse(lora_adapters=[pb.LoraAdapterInfo(name="alice",
                                                                  fingerprint="fp-1")])  # fmt: skip

    @grpc_stream_errors
    async def Generate(self, request, context):
        self.requests.append(request)
        raise UnknownLoraAdapterError(request.lora_name, [])
        yield  # an async generator, like the real method


class UnloadedAdapterPrefill(HeldPrefill):
    Stats = UnloadedAdapter.Stats

    @grpc_errors
    async def Prefill(self, request, context):
        raise UnknownLoraAdapterError(request.lora_name, ["bob"])


@pytest.mark.timeout(60)
def test_an_adapter_unloaded_after_placement_is_a_404_model_not_found(tmp_path):
    """A request raced an unload: the worker's refusal reaches the client as the 404 a
    request of an unknown model gets (OpenAI's envelope), from a prefill and a decode
    worker alike; it was a 400 naming lora_name, a field the client never sent."""

    async def scenario(registry: RedisRegistry) -> list[APIError]:
        (server_p, info_p), (server_d, info_d) = (
            await serve(UnloadedAdapterPrefill(), registry),
            await serve(UnloadedAdapter(fail=False), registry),
        )
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        errors = []
        try:
            await refreshed(pool)
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams(),
                                      lora=LoraRef("alice", "fp-1"))  # fmt: skip
            placement = Placement(info_d.worker_id, info_p.worker_id, 0, 0)
            with pytest.raises(APIError) as prefill:
                await dispatcher._prefill(request, placement)
            errors.append(prefill.value)
            with pytest.raises(APIError) as decode:
                lease = RemoteLease(lambda: None)
                async for _ in dispatcher._decode(request, placement, None, lease, set()):
                    pass
            errors.append(decode.value)
            return errors
        finally:
            await pool.close()
            await server_p.stop(None)
            await server_d.stop(None)

    for error in run_with_registry(tmp_path, scenario):
        assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
        assert error.body()["error"]["type"] == "invalid_request_error"
        assert "unknown LoRA adapter 'alice'" in error.message


@pytest.mark.timeout(60)
def test_a_finished_request_keeps_its_prefix_claims(tmp_path):
    """The consumer closes the stream once it has the finish (GeneratorExit): a success,
    so the claims that steer the next same-prefix request to this worker stay."""

    async def scenario(registry: RedisRegistry) -> int:
        server, info = await serve(Decode(fail=False), registry)
        index = PrefixIndex()
        pool, dispatcher = pool_and_dispatcher(registry, index)
        try:
            await refreshed(pool)
            hashes = hash_blocks(list(range(5, 53)), 16)
            stream = dispatcher.generate(SequenceRequest("r1", list(range(5, 53)), hashes,
                                                         pb.SamplingParams()))  # fmt: skip
            async for delta in stream:
                if delta.finish_reason:
                    break
            await stream.aclose()
            return index.match(hashes, [info.worker_id])[info.worker_id].gpu_blocks
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == 3


def decode_through(
    tmp_path,
    servicers,
    config: RouterConfig | None = None,
    first=None,
    sampling: pb.SamplingParams | None = None,
    deltas: list | None = None,
    metrics: list | None = None,
):
    """Run one sequence's ``_decode`` over fake decode workers registered in this order,
    tried in this order: (tokens, error message or None, migrations counted, last usage).
    ``deltas`` collects what the client side received; ``metrics``, the router's."""

    async def scenario(registry: RedisRegistry) -> tuple:
        servers = [await serve(servicer, registry) for servicer in servicers]
        ids = [info.worker_id for _, info in servers]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        if metrics is not None:
            metrics.append(dispatcher.metrics)
        tokens, error, usage = [], None, None
        try:
            await refreshed(pool)
            for state in pool.candidates(Role.DECODE):
                state.num_running = ids.index(state.worker_id)  # the least busy is tried first
            params = sampling or pb.SamplingParams()
            request = SequenceRequest("r1", list(range(5, 40)), [], params)
            placement = Placement(ids[0], "prefill@x", 0, 0)
            try:
                lease = RemoteLease(lambda: None)
                async for delta in dispatcher._decode(request, placement, first, lease, set()):
                    tokens += delta.token_ids
                    usage = delta.usage or usage
                    if deltas is not None:
                        deltas.append(delta)
            except APIError as exc:
                error = exc.message
            moved = dispatcher.metrics.registry.get_sample_value(
                "pdserve:decode_migrations_total", {"model_name": "m"}
            )
            return tokens, error, moved, usage
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    return run_with_registry(tmp_path, scenario)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_migrations", [0, 1, 2])
def test_a_sequence_migrates_with_the_tokens_sent_so_far(tmp_path, max_migrations):
    """Three decode workers: the first streams 1, 2 and fails, the second streams 3 and
    fails, the third finishes. Each next worker gets every token the client has (the
    prefill worker's 7 first) and no KV handle; ``max_decode_migrations`` bounds the moves,
    and past it the client gets the failure after the tokens it already has."""
    servicers = [Decode(True, (1, 2)), Decode(True, (3,)), Decode(False)]
    first = pb.PrefillResponse(first_token_id=7, num_cached_tokens=16)
    first.kv.lease_id = "lease-1"
    first.kv.num_tokens = 35
    config = RouterConfig(max_decode_migrations=max_migrations)
    tokens, error, moved, usage = decode_through(tmp_path, servicers, config, first)
    assert tokens == [1, 2, 3, 42][: [2, 3, 4][max_migrations]]
    assert moved == max_migrations
    assert (error is None) == (max_migrations == 2)
    if max_migrations == 2:
        assert usage.cached_tokens == 16  # where the prompt was first computed
    sent = [list(s.requests[0].output_token_ids) if s.requests else None for s in servicers]
    assert sent == [[7], [7, 1, 2], [7, 1, 2, 3]][: max_migrations + 1] + [None] * (
        2 - max_migrations
    )
    assert servicers[0].requests[0].HasField("kv")
    assert not any(s.requests[0].HasField("kv") for s in servicers[1:] if s.requests)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reason", ["draining", "engine_failed"])
def test_a_drain_is_said_as_planned_and_a_failed_engine_as_a_fault(tmp_path, caplog, reason):
    """Both turn the call away unstarted (the next worker serves it), but only a drain is
    planned: it was a WARNING per call ("failed", "down"), and an engine that failed is
    one; its refusal said "draining" too, and the router logged it at INFO."""
    with caplog.at_level(logging.INFO, logger="router"):
        tokens, error, _, _ = decode_through(tmp_path, [Draining(reason), Decode(False, (1,))])
    assert (tokens, error) == ([1, 42], None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if reason == "draining":
        assert warnings == []
    else:
        assert any("is down" in line for line in warnings), warnings


@pytest.mark.timeout(60)
def test_a_worker_that_refuses_a_moving_sequence_costs_no_migration(tmp_path):
    """The pool may not know yet that a worker drains, and migrations happen exactly when
    the pool's view is stale: a refusal (which says so in its trailing metadata) gives the
    move back, so the next worker still takes the sequence under the default of one."""
    servicers = [Decode(True, (1, 2)), Draining(), Decode(False)]
    tokens, error, moved, _ = decode_through(tmp_path, servicers)
    assert (tokens, error, moved) == ([1, 2, 42], None, 1)
    assert [len(s.requests) for s in servicers] == [1, 1, 1]
    assert list(servicers[2].requests[0].output_token_ids) == [1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ttl_s", [20.0, 0.0])
def test_the_lease_left_is_said_on_monotonic_clocks(tmp_path, ttl_s):
    """The decode worker timed its pull's start from the prefill worker's wall clock
    (``lease_expires_at``): hosts 25 s apart pulled blocks freed and reused (wrong tokens,
    no error), or refused every pull. The router says how long the lease has left as the
    Generate call leaves: the prefill worker's ``lease_ttl_s`` from when the router sent
    the Prefill call, on its own clock. A prefill worker from before (0) says nothing."""
    decode, prefill = Decode(fail=False, token_ids=(1,)), HeldPrefill(lease_ttl_s=ttl_s)
    prefill.go.set()

    async def scenario(registry: RedisRegistry) -> None:
        servers = [await serve(s, registry) for s in (decode, prefill)]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(),
                                               RouterConfig(min_disagg_tokens=0))  # fmt: skip
        try:
            await refreshed(pool)
            prompt = list(range(5, 40))
            request = SequenceRequest("r1", prompt, hash_blocks(prompt, 16), pb.SamplingParams())
            async for _ in dispatcher.generate(request):
                pass
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    run_with_registry(tmp_path, scenario)
    (sent,) = decode.requests
    assert sent.HasField("kv") and sent.kv.HasField("lease_left_s") == (ttl_s > 0)
    if ttl_s:
        assert ttl_s - 5 < sent.kv.lease_left_s <= ttl_s


def leased_first() -> pb.PrefillResponse:
    first = pb.PrefillResponse(first_token_id=7)
    first.kv.lease_id = "lease-1"
    first.kv.num_tokens = 35
    return first


class Stalled(Decode):
    """Sends ``token_ids`` (maybe none), then holds the stream open until cancelled."""

    async def Generate(self, request, context):
        self.requests.append(request)
        for token_id in self.token_ids:
            yield pb.GenerateResponse(token_ids=[token_id])
        await asyncio.Event().wait()
        yield pb.GenerateResponse()


async def client_leaves(
    pool: WorkerPool,
    dispatcher: Dispatcher,
    info: WorkerInfo,
    lease: RemoteLease,
    until: Callable[[], Awaitable[object]],
) -> None:
    """A client of one sequence whose KV ``lease`` the decode worker of ``info`` pulls,
    gone once ``until`` returns; the worker's counts are back to zero after."""
    request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams())
    placement = Placement(info.worker_id, "prefill@x", 0, 0)

    async def client() -> None:
        async for _ in dispatcher._decode(request, placement, leased_first(), lease, set()):
            pass

    task = asyncio.create_task(client())
    await until()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (state,) = pool.candidates(Role.DECODE)
    assert (state.num_running, state.kv_blocks_in_use) == (0, 0)


def with_a_leased_decode(tmp_path, decode: Decode, body: Callable[..., Awaitable[object]]):
    """``body(pool, dispatcher, info, lease, released)`` with ``decode`` served and
    registered; ``released`` holds "early" once ``lease`` was released."""

    async def scenario(registry: RedisRegistry) -> object:
        server, info = await serve(decode, registry)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        released: list[str] = []
        try:
            await refreshed(pool)
            lease = RemoteLease(lambda: released.append("early"))
            return await body(pool, dispatcher, info, lease, released)
        finally:
            await pool.close()
            await server.stop(None)

    return run_with_registry(tmp_path, scenario)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sent", [(), (1,)])
def test_a_client_gone_mid_pull_leaves_the_lease_to_expire(tmp_path, sent):
    """The client leaves while the decode worker has sent nothing (and never will): it may
    be reading the prefill worker's blocks, so no early release (reused under a READ that
    then completes, they would be cached as this prompt's). Once it has sent a chunk, it
    has the KV: the lease was released then."""
    decode = Stalled(fail=False, token_ids=sent)

    async def body(pool, dispatcher, info, lease, released) -> list[str]:
        async def until() -> None:
            while not decode.requests or (sent and not released):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)

        await client_leaves(pool, dispatcher, info, lease, until)
        lease.release()  # what _journey's finally does: nothing, if left to expire
        return released

    assert with_a_leased_decode(tmp_path, decode, body) == (["early"] if sent else [])


class SlowPull(Decode):
    """Answers its first chunk only after ``delay_s`` (a pull), then holds the stream open;
    notes when the router cancels it."""

    delay_s = 0.5

    async def Generate(self, request, context):
        self.requests.append(request)
        try:
            await asyncio.sleep(self.delay_s)
            yield pb.GenerateResponse(token_ids=[1])
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


@pytest.mark.timeout(60)
def test_a_client_gone_before_the_first_reply_still_frees_the_lease_when_the_pull_ends(tmp_path):
    """Cancelled at once when its client left, the call often ended before the decode
    worker admitted it, and no one released the lease: it held the prefill worker's
    blocks for lease_s (an audit: 114 of 128 blocks held, 29.6 s to a first token). The
    call is read on until its first reply (the pull's end): the lease is released then,
    and the call cancelled."""
    decode = SlowPull(fail=False)
    decode.cancelled = False

    async def body(pool, dispatcher, info, lease, released) -> list[str]:
        await client_leaves(pool, dispatcher, info, lease, lambda: asyncio.sleep(0.05))
        assert released == []  # sent, not answered: it may be reading
        for _ in range(200):
            if decode.cancelled:
                break
            await asyncio.sleep(0.02)
        assert decode.cancelled and len(decode.requests) == 1
        return released

    assert with_a_leased_decode(tmp_path, decode, body) == ["early"]


class Queued(Decode):
    """Says its engine holds the request (``ADMITTED_KEY``), then sends nothing: queued
    behind a full batch. Notes when the router cancels it."""

    async def Generate(self, request, context):
        self.requests.append(request)
        await context.send_initial_metadata(((ADMITTED_KEY, "1"),))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_at = time.monotonic()
            raise
        yield pb.GenerateResponse()


@pytest.mark.timeout(60)
def test_a_client_gone_while_queued_on_the_decode_worker_is_cancelled_at_once(tmp_path):
    """Once the decode worker's engine holds the request, its abort frees the lease (at
    once if it never pulled, by the transport's notice after a pull): the call is
    cancelled as soon as the client leaves, and the router leaves the lease to it. Read
    on for a first reply, a request queued behind a full batch held the lease (and then
    a slot, a pull and a step) for up to 30 s after its client left."""
    decode = Queued(fail=False)
    decode.cancelled_at = None

    async def body(pool, dispatcher, info, lease, released) -> tuple[list[str], float]:
        async def until() -> None:
            while not decode.requests:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the admission header is in

        await client_leaves(pool, dispatcher, info, lease, until)
        left_at = time.monotonic()
        while decode.cancelled_at is None:
            assert time.monotonic() - left_at < 5, "the queued call was not cancelled"
            await asyncio.sleep(0.01)
        lease.release()  # what _journey's finally does: nothing, the worker has it
        return released, decode.cancelled_at - left_at

    released, cancelled_after_s = with_a_leased_decode(tmp_path, decode, body)
    assert released == [] and cancelled_after_s < 2


@pytest.mark.timeout(60)
def test_a_decode_worker_that_refuses_leaves_the_kv_to_the_next(tmp_path):
    """A draining worker turns the call away before admitting it: it never pulled, so the
    next worker pulls the same lease instead of recomputing the prompt, and the lease is
    released once that one streams."""
    refusing, taking = Draining(), Decode(False, (1,))

    async def scenario(registry: RedisRegistry) -> tuple[list[int], list[bool], float]:
        servers = [await serve(refusing, registry), await serve(taking, registry)]
        ids = [info.worker_id for _, info in servers]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        released: list[bool] = []
        try:
            await refreshed(pool)
            for state in pool.candidates(Role.DECODE):
                state.num_running = ids.index(state.worker_id)  # the refusing one first
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams())
            placement = Placement(ids[0], "prefill@x", 0, 0)
            lease = RemoteLease(lambda: released.append(True))
            tokens = []
            async for delta in dispatcher._decode(request, placement, leased_first(), lease,
                                                  set()):  # fmt: skip
                tokens += delta.token_ids
            return tokens, released, dispatcher.metrics.decode_failures._value.get()
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    # A refusal is no failed hop: counted, every drain set off failure alerts.
    assert run_with_registry(tmp_path, scenario) == ([1, 42], [True], 0)
    assert refusing.requests[0].HasField("kv") and taking.requests[0].HasField("kv")
    assert taking.requests[0].kv.lease_id == "lease-1"


class PullFailed(Decode):
    """Fails every call as a worker whose KV pull failed under failure_policy: fail."""

    @grpc_stream_errors
    async def Generate(self, request, context):
        self.requests.append(request)
        raise RequestFailedError("pulling the prompt's KV from lease-1 failed")
        yield  # an async generator, like the real method


@pytest.mark.timeout(60)
def test_a_failed_pull_under_failure_policy_fail_is_the_clients_error_not_the_workers(tmp_path):
    """The request failed, not the worker: a 503 naming the KV move, no other worker
    tried (recomputing is what ``fail`` declines), and the worker stays in placement."""
    failing, other = PullFailed(fail=True), Decode(False)

    async def scenario(registry: RedisRegistry) -> tuple[str, bool]:
        servers = [await serve(failing, registry), await serve(other, registry)]
        ids = [info.worker_id for _, info in servers]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            for state in pool.candidates(Role.DECODE):
                state.num_running = ids.index(state.worker_id)
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams())
            placement = Placement(ids[0], "prefill@x", 0, 0)
            with pytest.raises(APIError) as failed:
                async for _ in dispatcher._decode(request, placement, leased_first(),
                                                  RemoteLease(lambda: None), set()):  # fmt: skip
                    pass
            return failed.value.message, pool.get(ids[0]).available
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    message, available = run_with_registry(tmp_path, scenario)
    assert "moving the prompt's KV to the decode worker failed" in message and available
    assert len(failing.requests) == 1 and not other.requests


@pytest.mark.timeout(60)
def test_a_prefill_worker_down_since_placement_is_passed_over(tmp_path):
    """The placement's prefill worker went down (or began draining) while the sequence
    waited for room on its decode worker: the prefill goes to the next one. The decode
    hop skipped such a worker and the prefill hop called it: a frozen one held the
    prefill until the pool's stall give-up."""
    chosen, other = HeldPrefill(), HeldPrefill()
    chosen.go.set()
    other.go.set()

    async def scenario(registry: RedisRegistry) -> tuple[int, int, bool]:
        (server_a, info_a), (server_b, info_b) = await serve(chosen, registry), await serve(
            other, registry)  # fmt: skip
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams())
            placement = Placement("decode@x", info_a.worker_id, 0, 0)
            pool.mark_unhealthy(info_a.worker_id)
            reply, worker, _ = await dispatcher._prefill(request, placement)
            assert reply is not None and worker is not None
            return chosen.num_calls, other.num_calls, worker.worker_id == info_b.worker_id
        finally:
            await pool.close()
            await server_a.stop(None)
            await server_b.stop(None)

    assert run_with_registry(tmp_path, scenario) == (0, 1, True)


class LatePrefill(HeldPrefill):
    """Answers after the router's deadline (it exported the prompt's KV all the same);
    records the releases it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[pb.ReleaseKVRequest] = []

    async def Prefill(self, request, context):
        await asyncio.sleep(0.5)
        return await super().Prefill(request, context)

    async def ReleaseKV(self, request, context):
        self.released.append(request)
        return pb.ReleaseKVResponse(released=True)


@pytest.mark.timeout(60)
def test_a_prefill_past_its_deadline_is_released_by_request_id(tmp_path):
    """The router gives up on a prefill worker (deadline); the worker may finish and
    export anyway: the router releases by request id at once, not after lease_s."""
    prefill = LatePrefill()
    prefill.go.set()

    async def scenario(registry: RedisRegistry) -> list[pb.ReleaseKVRequest]:
        server, info = await serve(prefill, registry)
        config = RouterConfig(prefill_timeout_s=0.1)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            request = SequenceRequest("r9", list(range(5, 40)), [], pb.SamplingParams())
            placement = Placement("decode@x", info.worker_id, 0, 0)
            assert (await dispatcher._prefill(request, placement))[:2] == (None, None)  # local
            while not prefill.released:
                await asyncio.sleep(0.01)
            return prefill.released
        finally:
            await pool.close()
            await server.stop(None)

    (release,) = run_with_registry(tmp_path, scenario)
    assert release.request_id == "r9"


@pytest.mark.timeout(60)
def test_a_prefill_try_past_the_deadline_counts_no_queued_tokens(tmp_path):
    """The first prefill worker used up the sequence's deadline: the next one is not
    called, and keeps no queued tokens (they were added before the deadline check, which
    left outside the try that takes them back: that worker was then passed over by
    placement until it restarted)."""
    first, second = HeldPrefill(), HeldPrefill()  # never answer

    async def scenario(registry: RedisRegistry) -> tuple[list[int], list[int]]:
        (server_a, info_a), (server_b, _) = await serve(first, registry), await serve(
            second, registry)  # fmt: skip
        config = RouterConfig(prefill_timeout_s=120.0)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            request = SequenceRequest("r1", list(range(5, 305)), [], pb.SamplingParams())
            placement = Placement("decode@x", info_a.worker_id, 0, 0)
            deadline = time.monotonic() + 0.5
            assert (await dispatcher._prefill(request, placement, deadline))[:2] == (None, None)
            queued = [w.queued_prefill_tokens for w in pool.workers.values()]
            return [first.num_calls, second.num_calls], queued
        finally:
            await pool.close()
            await server_a.stop(None)
            await server_b.stop(None)

    assert run_with_registry(tmp_path, scenario) == ([1, 0], [0, 0])


@pytest.mark.timeout(60)
def test_a_worker_that_left_during_a_call_is_not_claimed_for(tmp_path):
    """A retried prefill (or an embedding) landed on a worker that left while the call
    ran: claiming its blocks then gave it a slot in the prefix index that nothing freed
    (each such slot widens every block's owner mask for good)."""
    prefill = HeldPrefill()

    async def scenario(registry: RedisRegistry) -> tuple[bool, bool]:
        server, info = await serve(prefill, registry)
        index = PrefixIndex()
        pool, dispatcher = pool_and_dispatcher(registry, index)
        try:
            await refreshed(pool)
            hashes = [b"h" * 32]
            dispatcher._moved(hashes, None, info.worker_id)  # still in the pool: claimed
            claimed = info.worker_id in index._bits
            index.clear_worker(info.worker_id)  # it left (``EventListener.remove``)
            del pool.workers[info.worker_id]
            dispatcher._moved(hashes, None, info.worker_id)
            return claimed, info.worker_id in index._bits
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == (True, False)


@pytest.mark.timeout(60)
def test_only_a_local_prefill_scores_the_prompt(tmp_path):
    """With prompt_logprobs, the decode worker that prefills locally scores the prompt and
    the client gets the scores once, with the first tokens; a worker the sequence moves to
    (the client has the scores) and one that pulls a prefill worker's KV are not asked."""
    sampling = pb.SamplingParams(prompt_logprobs=1)
    servicers, deltas = [Decode(True, (1, 2)), Decode(False)], []
    tokens, error, moved, _ = decode_through(tmp_path, servicers, sampling=sampling, deltas=deltas)
    assert (tokens, error, moved) == ([1, 2, 42], None, 1)
    asked = [s.requests[0].sampling.HasField("prompt_logprobs") for s in servicers]
    assert asked == [True, False]
    scored = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert scored == [scores(list(range(5, 40)))]
    pulled = Decode(False, (3,))
    first = pb.PrefillResponse(first_token_id=7, prompt_logprobs=scores(list(range(5, 40))))
    first.kv.lease_id = "lease-1"
    deltas = []
    decode_through(tmp_path, [pulled], first=first, sampling=sampling, deltas=deltas)
    assert not pulled.requests[0].sampling.HasField("prompt_logprobs")
    assert all(d.prompt_logprobs is None for d in deltas)  # the prefill's come via _journey


def test_a_local_prefills_queueing_and_prefill_are_observed_and_a_pulled_ones_are_not(tmp_path):
    """The decode worker's timings of a prompt it computed itself are the request's
    queueing and prefill (those of local prefills, every request of a colocated
    deployment, went unrecorded); after a pull they are not prompt work."""

    def observed(first, old: bool = False) -> tuple[float | None, float | None]:
        got: list = []
        decode_through(tmp_path, [Decode(False, (1, 2), old=old)], first=first, metrics=got)
        labels = {"model_name": "m"}
        sample = got[0].registry.get_sample_value
        return (sample("pdserve:ttft_queue_seconds_count", labels),
                sample("pdserve:ttft_prefill_seconds_sum", labels))  # fmt: skip

    assert observed(None) == (1.0, 0.007)
    pulled = pb.PrefillResponse(first_token_id=7)
    pulled.kv.lease_id = "lease-1"
    assert observed(pulled) == (0.0, 0.0)
    # A decode worker of a build that said them with its last reply only (mid-upgrade):
    # they were never observed.
    assert observed(None, old=True) == (1.0, 0.007)


class Lingering(Decode):
    """Ends 0.2 s after its last reply (a handler unwinding), noting a cancellation."""

    def __init__(self) -> None:
        super().__init__(fail=False, token_ids=(1, 2, 3))
        self.cancelled = False

    async def Generate(self, request, context):
        async for reply in super().Generate(request, context):
            yield reply
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


@pytest.mark.timeout(60)
def test_a_sequence_ended_early_is_observed_and_a_finished_call_ends_by_itself(tmp_path):
    """The decode worker's stage timings and pulled blocks came with its last reply, which
    a sequence the router ends early (a stop string, a client gone) never reaches: its
    prompt went unobserved. They come with the first now. And a call whose last reply
    came was cancelled while its handler unwound: the worker's span said cancelled."""
    decode = Lingering()

    async def scenario(registry: RedisRegistry) -> tuple[float | None, bool]:
        server, info = await serve(decode, registry)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            sampling = pb.SamplingParams(prompt_logprobs=0)  # (a local prefill's)
            request = SequenceRequest("r1", list(range(5, 40)), [], sampling)
            placement = Placement(info.worker_id, None, 0, 0)
            lease = RemoteLease(lambda: None)
            early = dispatcher._decode(request, placement, None, lease, set())
            await anext(early)  # a stop string in its first token: the router stops
            await early.aclose()
            queued = dispatcher.metrics.registry.get_sample_value(
                "pdserve:ttft_queue_seconds_count", {"model_name": "m"}
            )
            await asyncio.sleep(0.5)  # (that call, cut short, is cancelled: as it should be)
            decode.cancelled = False
            whole = dispatcher._decode(request, placement, None, lease, set())
            async for delta in whole:
                if delta.finish_reason:
                    break  # the client has its last token
            await whole.aclose()
            await asyncio.sleep(0.5)
            return queued, decode.cancelled
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == (1.0, False)


@pytest.mark.timeout(60)
def test_a_prompt_to_score_is_placed_as_uncached(tmp_path):
    """A worker's cached prefix saves a scoring request nothing (it computes the whole
    prompt for the logits), so placement neither credits nor counts it as cached."""

    async def scenario(registry: RedisRegistry) -> list[Placement]:
        server, info = await serve(Decode(fail=False), registry)
        index = PrefixIndex()
        pool, dispatcher = pool_and_dispatcher(registry, index)
        try:
            await refreshed(pool)
            prompt = list(range(5, 53))
            hashes = hash_blocks(prompt, 16)
            index.apply(info.worker_id, [BlockStored(hashes, None, prompt, 16)])
            placements = []
            for sampling in (pb.SamplingParams(), pb.SamplingParams(prompt_logprobs=0)):
                request = SequenceRequest("r", prompt, hashes, sampling)
                placements.append(dispatcher.place(request))
            return placements
        finally:
            await pool.close()
            await server.stop(None)

    plain, scoring = run_with_registry(tmp_path, scenario)
    assert plain.decode_cached_tokens > 0
    assert scoring.decode_cached_tokens == 0


@pytest.mark.timeout(60)
def test_the_samples_of_one_prompt_count_one_use_of_it(tmp_path):
    """n=8 samples of a 1,000-token prompt p0 holds, p0's queue the first sample's
    prefill: every later sample stays with p0. Counted as 8 uses, the prompt looked shared
    by 8 requests, and from the 6th sample on it was recomputed on the idle p1 (twice the
    work); 8 requests asking for it do move it."""

    async def scenario(registry: RedisRegistry) -> tuple[list[str], list[str]]:
        servers = [await serve(s, registry) for s in (Decode(fail=False), HeldPrefill(),
                                                       HeldPrefill())]  # fmt: skip
        index = PrefixIndex()
        pool, dispatcher = pool_and_dispatcher(registry, index,
                                               RouterConfig(min_disagg_tokens=0))  # fmt: skip
        try:
            await refreshed(pool)
            holder = servers[1][1].worker_id
            prompt = list(range(5, 1005))
            hashes = hash_blocks(prompt, 16)
            index.apply(holder, [BlockStored(hashes, None, prompt[: 16 * len(hashes)], 16)])
            next(w for w in pool.candidates(Role.PREFILL)
                 if w.worker_id == holder).queued_prefill_tokens = 1500  # fmt: skip
            placed = {}
            for sibling in (True, False):  # the samples of one prompt; then 8 requests
                placed[sibling] = [
                    dispatcher.place(SequenceRequest(f"r{i}", prompt, hashes, pb.SamplingParams(),
                                                     sibling=sibling and i > 0)).prefill_worker
                    for i in range(8)
                ]  # fmt: skip
            names = {holder: "holder"}
            return tuple([names.get(w, "other") for w in placed[k]] for k in (True, False))
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    samples, requests = run_with_registry(tmp_path, scenario)
    assert samples == ["holder"] * 8
    assert "other" in requests


@pytest.mark.timeout(60)
def test_a_hybrid_decode_worker_counts_no_snapshot_past_what_its_engine_resumes(tmp_path):
    """A 48-token prompt: the engine computes its last token, so it resumes at most from
    the snapshot after block 2. One after block 3 (a rolling snapshot ending where the
    prompt does) counted 47 tokens as held, and the decode worker recomputed all 48."""

    async def scenario(registry: RedisRegistry) -> Placement:
        server, info = await serve(Decode(fail=False), registry)
        index = PrefixIndex()
        pool, dispatcher = pool_and_dispatcher(registry, index, hybrid=True)
        try:
            await refreshed(pool)
            prompt = list(range(5, 53))
            hashes = hash_blocks(prompt, 16)
            snapshots = StateStored([hashes[0], hashes[2]])
            index.apply(info.worker_id, [BlockStored(hashes, None, prompt, 16), snapshots])
            return dispatcher.place(SequenceRequest("r", prompt, hashes, pb.SamplingParams()))
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario).decode_cached_tokens == 16


@pytest.mark.timeout(60)
def test_a_burst_sharing_a_prefix_spreads_while_it_prefills(tmp_path):
    """Sequences still in prefill count as load on the decode worker placed for them: a
    burst sharing a prefix that one decode worker caches no longer lands there whole
    (before, their load showed only once their decode calls began: all 16 went there)."""
    holder, other, prefill = Decode(fail=False), Decode(fail=False), HeldPrefill()
    shared = list(range(100, 148))  # 3 blocks, cached on the holder

    async def scenario(registry: RedisRegistry) -> list[tuple[int, int]]:
        servers = [await serve(s, registry) for s in (holder, other, prefill)]
        index = PrefixIndex()
        config = RouterConfig(min_disagg_tokens=0)
        pool, dispatcher = pool_and_dispatcher(registry, index, config)
        try:
            await refreshed(pool)
            index.apply(servers[0][1].worker_id, [BlockStored(hash_blocks(shared, 16), None,
                                                               shared, 16)])  # fmt: skip

            async def one(i: int) -> None:
                prompt = shared + [1000 + i, 2000 + i, 3000 + i, 4000 + i]
                request = SequenceRequest(f"r{i}", prompt, hash_blocks(prompt, 16),
                                          pb.SamplingParams())  # fmt: skip
                async for _ in dispatcher.generate(request):
                    pass

            burst = [asyncio.create_task(one(i)) for i in range(16)]
            while prefill.num_calls < 16:
                await asyncio.sleep(0.01)
            prefill.go.set()
            await asyncio.gather(*burst)
            return [(w.assigned, w.num_running) for w in pool.candidates(Role.DECODE)]
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [(0, 0), (0, 0)]  # nothing left counted
    # The prefix is worth 0.5 * 48/52 of a load of 1, 1/8 per sequence: about 4 more go to
    # the holder first; once the other has one, its claim on the prefix evens the bonus.
    assert len(holder.requests) + len(other.requests) == 16
    assert len(holder.requests) >= len(other.requests) >= 5


class HeldDecode(Decode):
    """Keeps each stream open until ``finish`` lets one end (with 42)."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.finish = asyncio.Semaphore(0)

    async def Generate(self, request, context):
        self.requests.append(request)
        await self.finish.acquire()
        timings = pb.StageTimings(queue_ms=5, prefill_ms=7)
        yield pb.GenerateResponse(token_ids=[42], finish_reason="length", usage=pb.Usage(),
                                  timings=timings)  # fmt: skip


# What lets only some of a burst of six 3-block prompts prefill while the decode worker
# streams: (decode_queue_factor, the decode worker's KV blocks, prompts share their two
# full blocks, how many prefill at first).
LIMITS = {
    "sequences": (0.25, 0, False, 2),  # 0.25 x max_num_seqs 8 = 2 sequences ahead
    "kv_blocks": (1.0, 6, False, 2),  # 8 sequences, but 6 blocks: 2 prompts of 3
    "shared_prefix": (1.0, 6, True, 4),  # 2 shared blocks + 1 partial block each: 3+1+1+1
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", LIMITS)
def test_prefills_wait_in_line_while_their_decode_worker_is_full(tmp_path, limit):
    """Backpressure: only as many sequences as fit ahead on the decode worker (counted in
    sequences, and in distinct prompt blocks against its KV cache) are prefilled while its
    streams are held (more KV would sit leased, unpullable); the rest go as streams end,
    in arrival order; nothing stays counted or in line."""
    factor, kv_blocks_total, shared, first_wave = LIMITS[limit]
    decode, prefill = HeldDecode(), HeldPrefill()
    prefill.go.set()

    async def scenario(registry: RedisRegistry) -> list[tuple[int, ...]]:
        servers = [await serve(decode, registry, kv_blocks_total), await serve(prefill, registry)]
        config = RouterConfig(min_disagg_tokens=0, decode_queue_factor=factor)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)

            async def one(i: int) -> None:
                mine = [1000 + i]
                prompt = list(range(5, 37)) + mine if shared else mine + list(range(5, 40))
                request = SequenceRequest(f"r{i}", prompt, hash_blocks(prompt, 16),
                                          pb.SamplingParams())  # fmt: skip
                async for _ in dispatcher.generate(request):
                    pass

            async def settle(num_prefilled: int) -> None:
                deadline = time.monotonic() + 10
                while prefill.num_calls < num_prefilled and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)  # and no more than that

            burst = []
            for i in range(6):
                burst.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.02)  # arrival order
            await settle(first_wave)
            assert prefill.num_calls == first_wave
            decode.finish.release()
            await settle(first_wave + 1)
            assert prefill.num_calls == first_wave + 1
            for _ in range(5):  # one at a time: prefills let go together may race
                before = len(decode.requests)
                decode.finish.release()
                deadline = time.monotonic() + 10
                while before == len(decode.requests) < 6 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            await asyncio.gather(*burst)
            (state,) = pool.candidates(Role.DECODE)
            ahead = state.ahead
            return [(state.assigned, state.num_running, len(state.gate), ahead.num_seqs,
                     ahead.num_blocks)]  # fmt: skip
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [(0, 0, 0, 0, 0)]
    assert [r.request_id for r in decode.requests] == [f"r{i}" for i in range(6)]


@pytest.mark.timeout(60)
def test_a_sequence_waits_for_room_no_longer_than_request_timeout_s(tmp_path):
    """``request_timeout_s`` runs from admission: a sequence still in line for a full
    decode worker when it passes gets a 503 saying so (it was unbounded: only the decode
    call had a deadline), never prefilled; nothing stays counted or in line."""
    decode, prefill = HeldDecode(), HeldPrefill()
    prefill.go.set()

    async def scenario(registry: RedisRegistry) -> tuple:
        servers = [await serve(decode, registry), await serve(prefill, registry)]
        config = RouterConfig(min_disagg_tokens=0, decode_queue_factor=0.125,
                              request_timeout_s=0.5)  # fmt: skip
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        # The one ahead goes through a dispatcher of the same pool (the same line) whose
        # deadline is far: it must not leave the line first.
        patient = Dispatcher(dataclasses.replace(config, request_timeout_s=30.0), pool,
                             dispatcher.index, dispatcher.index_lock, dispatcher.policy,
                             dispatcher.metrics, 16)  # fmt: skip
        try:
            await refreshed(pool)

            async def one(i: int, through: Dispatcher) -> str | None:
                prompt = [1000 + i, *range(5, 40)]
                request = SequenceRequest(f"r{i}", prompt, hash_blocks(prompt, 16),
                                          pb.SamplingParams())  # fmt: skip
                try:
                    async for _ in through.generate(request):
                        pass
                except APIError as exc:
                    return exc.message
                return None

            held = asyncio.create_task(one(0, patient))  # 0.125 x 8 = one sequence ahead
            while not decode.requests:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            waited = await one(1, dispatcher)
            elapsed = time.monotonic() - started
            decode.finish.release()
            assert await held is None
            (state,) = pool.candidates(Role.DECODE)
            counts = (state.assigned, state.num_running, len(state.gate), state.ahead.num_seqs)
            return waited, elapsed, prefill.num_calls, counts
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    waited, elapsed, num_prefills, counts = run_with_registry(tmp_path, scenario)
    assert "waited router.request_timeout_s for room" in waited and 0.3 < elapsed < 2
    assert num_prefills == 1 and counts == (0, 0, 0, 0)


@pytest.mark.timeout(60)
def test_sequences_waiting_for_a_decode_worker_that_went_down_are_placed_again(tmp_path):
    """They are not prefilled for it (their KV would go to a dead worker and the decode
    side would recompute it): they go back to placement, a 503 here with no other decode
    worker; nothing stays counted or in line."""
    decode, prefill = HeldDecode(), HeldPrefill()
    prefill.go.set()

    async def scenario(registry: RedisRegistry) -> list[object]:
        servers = [await serve(decode, registry), await serve(prefill, registry)]
        config = RouterConfig(min_disagg_tokens=0, decode_queue_factor=0.125)  # 1 ahead
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            (state,) = pool.candidates(Role.DECODE)

            async def one(i: int) -> None:
                prompt = [1000 + i] + list(range(5, 40))
                request = SequenceRequest(f"r{i}", prompt, hash_blocks(prompt, 16),
                                          pb.SamplingParams())  # fmt: skip
                async for _ in dispatcher.generate(request):
                    pass

            first = asyncio.create_task(one(0))
            while not decode.requests:
                await asyncio.sleep(0.01)
            second = asyncio.create_task(one(1))
            await asyncio.sleep(0.2)
            assert len(state.gate) == 1
            pool.mark_unhealthy(state.worker_id)  # as a failed call to it does
            try:
                await asyncio.wait_for(second, 5)
            except APIError as exc:
                outcome = exc.status
            decode.finish.release()
            await first
            return [outcome, prefill.num_calls, len(state.gate), state.ahead.num_seqs,
                    state.assigned]  # fmt: skip
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [503, 1, 0, 0, 0]


@pytest.mark.timeout(60)
def test_a_sequence_whose_decode_workers_keep_going_down_never_skips_the_line(tmp_path):
    """Each worker it is placed on goes down while it waits (``_room_on`` finds none):
    after the last re-placement it is refused, not prefilled for a worker it never had
    room on (the last one used to go unchecked); nothing stays counted."""
    decode, prefill = HeldDecode(), HeldPrefill()
    prefill.go.set()
    decode.finish.release()

    async def scenario(registry: RedisRegistry) -> list[object]:
        servers = [await serve(decode, registry), await serve(prefill, registry)]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(),
                                               RouterConfig(min_disagg_tokens=0))  # fmt: skip
        checks = []

        async def gone(worker, request, num_blocks):
            checks.append(worker.worker_id)
            return None

        dispatcher._room_on = gone
        try:
            await refreshed(pool)
            (state,) = pool.candidates(Role.DECODE)
            prompt = list(range(5, 40))
            request = SequenceRequest("r", prompt, hash_blocks(prompt, 16), pb.SamplingParams())
            with pytest.raises(APIError) as info:
                async for _ in dispatcher.generate(request):
                    pass
            return [info.value.status, len(checks), prefill.num_calls, state.assigned]
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [503, 4, 0, 0]


@pytest.mark.timeout(60)
def test_a_restarted_decode_worker_keeps_its_line_and_what_is_ahead(tmp_path):
    """A new engine behind the same worker id gets a new WorkerState; the router's line
    and count for that id carry over (a fresh count let the whole line through)."""
    decode = Decode(fail=False)

    async def scenario(registry: RedisRegistry) -> list[bool]:
        server, info = await serve(decode, registry)
        pool, _ = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            (old,) = pool.candidates(Role.DECODE)
            leave = old.ahead.join([], 1)
            registry.register(dataclasses.replace(info, engine_id="restarted"))
            await refreshed(pool)
            (new,) = pool.candidates(Role.DECODE)
            kept = [new is not old, new.ahead is old.ahead, new.gate is old.gate,
                    new.ahead.num_seqs == 1]  # fmt: skip
            leave()
            return kept
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [True, True, True, True]


def vector(value: float) -> bytes:
    """Four float32 copies of ``value``, as Embed sends a vector."""
    return struct.pack("<4f", *[value] * 4)


class EmbeddingPrefill(HeldPrefill):
    """A prefill worker's Embed: fails with ``status`` (INVALID_ARGUMENT naming "input"),
    or answers four copies of ``value``."""

    def __init__(self, value: float, status: grpc.StatusCode | None = None) -> None:
        super().__init__()
        self.value = value
        self.status = status
        self.embeds: list[pb.EmbedRequest] = []

    async def Embed(self, request, context):
        self.embeds.append(request)
        if self.status is not None:
            metadata = (
                ((PARAM_KEY, "input"),) if self.status is grpc.StatusCode.INVALID_ARGUMENT else ()
            )
            await context.abort(self.status, "no", metadata)
        return pb.EmbedResponse(embedding=vector(self.value), num_cached_tokens=16)


class EmbeddingDecode(Decode):
    """A decode worker's Embed: four copies of ``value``, once ``go`` is set."""

    def __init__(self, value: float) -> None:
        super().__init__(fail=False)
        self.value = value
        self.embeds: list[pb.EmbedRequest] = []
        self.go = asyncio.Event()
        self.go.set()

    async def Embed(self, request, context):
        self.embeds.append(request)
        await self.go.wait()
        return pb.EmbedResponse(embedding=vector(self.value))


def embed_through(
    tmp_path, servicers, config: RouterConfig | None = None
) -> tuple[object, dict[str, int]]:
    """One embedding over fake workers (every prompt placed on a prefill worker): the
    reply or the APIError, and each worker's prefix claims after it, by servicer index."""
    config = config or RouterConfig(min_disagg_tokens=0)

    async def scenario(registry: RedisRegistry) -> tuple:
        servers = [await serve(servicer, registry) for servicer in servicers]
        index = PrefixIndex()
        pool, dispatcher = pool_and_dispatcher(registry, index, config)
        try:
            await refreshed(pool)
            prompt = list(range(5, 53))
            hashes = hash_blocks(prompt, 16)
            request = SequenceRequest("e1", prompt, hashes, pb.SamplingParams())
            try:
                outcome = await embed(dispatcher, request, normalize=True)
            except APIError as exc:
                outcome = exc
            ids = [info.worker_id for _, info in servers]
            claims = index.match(hashes, ids)
            for reason in ("stop", "error"):  # the one way it ended is counted
                ended = dispatcher.metrics.registry.get_sample_value(
                    "vllm:request_success_total", {"model_name": "m", "finished_reason": reason}
                )
                expected = "stop" if isinstance(outcome, pb.EmbedResponse) else "error"
                assert (ended or 0) == (reason == expected), reason
            return outcome, {i: claims[w].gpu_blocks for i, w in enumerate(ids)}
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    return run_with_registry(tmp_path, scenario)


@pytest.mark.timeout(60)
def test_an_embedding_ends_by_the_request_timeout_as_a_generation_does(tmp_path, caplog):
    """Each try took a whole prefill_timeout_s: four frozen workers held an embedding 20 s
    past a request_timeout_s of 2 (a clocks audit). The tries share the deadline, and the
    one it cut is not the worker's failure."""
    frozen = [EmbeddingDecode(1.0), EmbeddingDecode(2.0)]
    for servicer in frozen:
        servicer.go.clear()  # (it never answers)
    config = RouterConfig(min_disagg_tokens=0, request_timeout_s=1.0, prefill_timeout_s=5.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="router"):
        error, _ = embed_through(tmp_path, frozen, config)
    assert isinstance(error, APIError) and "request_timeout_s" in error.message
    assert time.monotonic() - started < 4  # not 2 x 5 s
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


class SlowEmbedding(EmbeddingDecode):
    async def Embed(self, request, context):
        await asyncio.sleep(0.7)
        return await super().Embed(request, context)


@pytest.mark.timeout(60)
def test_an_embeddings_inputs_share_one_deadline(tmp_path):
    """Each input's deadline began when its lane took it: 4 inputs of 0.7 s on 1 lane ran
    2.8 s past a request_timeout_s of 1. They share the request's."""
    config = RouterConfig(min_disagg_tokens=0, request_timeout_s=1.0, prefill_timeout_s=5.0)

    async def scenario(registry: RedisRegistry) -> tuple[object, float]:
        server, _ = await serve(SlowEmbedding(1.0), registry)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            body = EmbeddingRequest(input="x")
            started = time.monotonic()
            try:
                outcome = await embed_all(dispatcher, [list(range(5, 40))] * 4, "e", 16, None,
                                          body, lanes=1, normalize=True)  # fmt: skip
            except APIError as exc:
                outcome = exc
            return outcome, time.monotonic() - started
        finally:
            await pool.close()
            await server.stop(None)

    outcome, took_s = run_with_registry(tmp_path, scenario)
    assert isinstance(outcome, APIError) and "request_timeout_s" in outcome.message
    assert took_s < 2


@pytest.mark.timeout(60)
def test_an_embedding_goes_on_to_the_next_worker_and_claims_only_where_it_ran(tmp_path):
    """One prefill worker fails as if down, the other is of a build without Embed (a
    rolling upgrade): the decode worker computes it. The prompt's prefix is then claimed
    on the decode worker alone."""
    old, down = grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE
    servicers = [EmbeddingPrefill(1.0, old), EmbeddingPrefill(2.0, down), EmbeddingDecode(3.0)]
    reply, claims = embed_through(tmp_path, servicers)
    assert reply.embedding == vector(3.0)
    assert [len(s.embeds) for s in servicers] == [1, 1, 1]
    assert all(s.embeds[0].normalize and list(s.embeds[0].token_ids) == list(range(5, 53))
               for s in servicers)  # fmt: skip
    assert claims == {0: 0, 1: 0, 2: 3}


@pytest.mark.timeout(60)
def test_an_embeddings_invalid_input_is_a_400_and_not_tried_again(tmp_path):
    bad = grpc.StatusCode.INVALID_ARGUMENT
    servicers = [EmbeddingPrefill(1.0, bad), EmbeddingPrefill(1.0, bad), EmbeddingDecode(3.0)]
    error, claims = embed_through(tmp_path, servicers)
    assert isinstance(error, APIError) and (error.status, error.param) == (400, "input")
    assert sum(len(s.embeds) for s in servicers) == 1
    assert claims == {0: 0, 1: 0, 2: 0}


@pytest.mark.timeout(60)
def test_embeddings_in_flight_count_in_a_decode_workers_load(tmp_path):
    """Short inputs go to decode workers (below min_disagg_tokens). While their calls run
    they count as that worker's sequences, so a burst spreads over both workers instead
    of all landing on the one that looked idle first (a review found 16 of 16 on one);
    once they end, nothing is left counted."""
    workers = [EmbeddingDecode(1.0), EmbeddingDecode(2.0)]
    for worker in workers:
        worker.go.clear()

    async def scenario(registry: RedisRegistry) -> list[int]:
        servers = [await serve(worker, registry) for worker in workers]
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            states = pool.candidates(Role.DECODE)
            states[0].num_running = 1  # one looks busier to begin with
            calls = [
                asyncio.ensure_future(embed(dispatcher, SequenceRequest(
                    f"e{i}", [5 + i] * 20, hash_blocks([5 + i] * 20, 16), pb.SamplingParams()),
                    normalize=True))
                for i in range(16)
            ]  # fmt: skip
            while sum(len(w.embeds) for w in workers) < 16:
                await asyncio.sleep(0.01)
            assert sum(s.assigned for s in states) == 16
            for worker in workers:
                worker.go.set()
            await asyncio.gather(*calls)
            assert [(s.assigned, s.assigned_blocks) for s in states] == [(0, 0), (0, 0)]
            return [len(w.embeds) for w in workers]
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    spread = run_with_registry(tmp_path, scenario)
    assert sum(spread) == 16 and min(spread) >= 6, spread  # not 0 and 16: loads balance


class CountingDecode(Decode):
    """Embed answers its first token id (as four floats) after a moment; counts how many
    calls it held at once."""

    def __init__(self) -> None:
        super().__init__(fail=False)
        self.now = self.most_at_once = 0

    async def Embed(self, request, context):
        self.now += 1
        self.most_at_once = max(self.most_at_once, self.now)
        await asyncio.sleep(0.01)
        self.now -= 1
        return pb.EmbedResponse(embedding=vector(float(request.token_ids[0])))


@pytest.mark.timeout(60)
def test_a_requests_inputs_run_a_few_lanes_at_a_time_and_come_back_in_order(tmp_path):
    worker = CountingDecode()
    prompts = [[5 + i, 6] for i in range(40)]

    async def scenario(registry: RedisRegistry) -> list[bytes]:
        server, _ = await serve(worker, registry)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex())
        try:
            await refreshed(pool)
            body = EmbeddingRequest(input=prompts)
            replies = await embed_all(
                dispatcher, prompts, "r", 16, None, body, lanes=8, normalize=True
            )
            return [reply.embedding for reply in replies]
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [vector(float(5 + i)) for i in range(40)]
    assert worker.most_at_once == 8


@pytest.mark.timeout(120)  # (its first use of tiny_llama makes the model)
def test_a_worker_that_ignores_logit_token_ids_is_a_503_not_a_score(tiny_llama, tmp_path):
    """A worker from before ``logit_token_ids`` (mid-upgrade) answers a hidden state; read
    as two logits it would give a confident, wrong score. The router refuses it (503,
    retry later) and holds nothing after."""
    import httpx

    from common.config_loader import load_config
    from router.app import create_app
    from router.state import RouterState
    from tests.common.redis_server import redis_server

    with redis_server(tmp_path) as url:
        registry = RedisRegistry(url, ttl_s=30.0)
        state = RouterState.build(load_config(None, [
            f"model={tiny_llama}", f"registry.redis_url={url}",
            "router.score_method=token_logits", 'router.score_tokens=["no", "ok"]',
        ]))  # fmt: skip
        body = {"query": "where", "documents": ["here", "there"]}

        async def scenario() -> httpx.Response:
            server, _ = await serve(CountingDecode(), registry)  # four floats, always
            try:
                await state.pool.refresh()
                transport = httpx.ASGITransport(create_app(state))
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://127.0.0.1"
                ) as client:
                    return await client.post("/v1/rerank", json=body)
            finally:
                await state.pool.close()
                await server.stop(None)

        try:
            reply = asyncio.run(scenario())
        finally:
            registry.close()
            state.pool.registry.close()
    assert reply.status_code == 503, reply.text
    assert "vectors of [4] floats where 2 were asked for" in reply.json()["error"]["message"]
    assert state.num_inflight == 0


@pytest.mark.timeout(60)
def test_a_higher_priority_sequence_passes_a_line_full_of_lower_ones(tmp_path):
    """Two priority-5 sequences fill the decode worker's room (0.25 x 8): a priority-0
    one goes through at once, for its engine to preempt one of them; it waited for one
    to end (the engine never saw it, so never preempted). Another priority-5 one waits."""
    decode, prefill = HeldDecode(), HeldPrefill()
    prefill.go.set()

    async def scenario(registry: RedisRegistry) -> tuple[list[str], list[str]]:
        servers = [await serve(decode, registry), await serve(prefill, registry)]
        config = RouterConfig(min_disagg_tokens=0, decode_queue_factor=0.25)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)

            async def one(name: str, priority: int) -> None:
                prompt = [1000 + len(name) + priority, *range(5, 40)]
                request = SequenceRequest(name, prompt, hash_blocks(prompt, 16),
                                          pb.SamplingParams(), priority=priority)  # fmt: skip
                async for _ in dispatcher.generate(request):
                    pass

            async def reached(count: int) -> list[str]:
                deadline = time.monotonic() + 10
                while len(decode.requests) < count and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)  # and no more than that
                return [r.request_id for r in decode.requests]

            tasks = [asyncio.create_task(one(f"low{i}", 5)) for i in range(2)]
            await reached(2)
            tasks.append(asyncio.create_task(one("late", 5)))
            await asyncio.sleep(0.1)
            tasks.append(asyncio.create_task(one("urgent", 0)))
            first = await reached(3)
            for _ in range(4):
                decode.finish.release()
            await asyncio.gather(*tasks)
            (state,) = pool.candidates(Role.DECODE)
            assert (state.ahead.num_seqs, len(state.gate)) == (0, 0)
            return first, [r.request_id for r in decode.requests]
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    first, every = run_with_registry(tmp_path, scenario)
    assert sorted(first[:2]) == ["low0", "low1"] and first[2:] == ["urgent"]
    assert every[3:] == ["late"]


class Stalling(Decode):
    """Sends one token, then nothing (a long generation the router's deadline cuts)."""

    def __init__(self) -> None:
        super().__init__(fail=False)

    async def Generate(self, request, context):
        self.requests.append(request)
        yield pb.GenerateResponse(token_ids=[7])
        await asyncio.Event().wait()


@pytest.mark.timeout(60)
def test_a_stream_the_routers_deadline_cuts_says_so_and_blames_no_worker(tmp_path):
    """The router's own deadline ended the decode call (DEADLINE_EXCEEDED): the client was
    told "the decode worker failed", decode_failures counted it, and the healthy worker
    was tried again."""
    decode = Stalling()

    async def scenario(registry: RedisRegistry) -> tuple[str, float, bool, int]:
        server, info = await serve(decode, registry)
        config = RouterConfig(min_disagg_tokens=10**6, request_timeout_s=0.5)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            request = SequenceRequest("r1", list(range(5, 40)), [], pb.SamplingParams())
            with pytest.raises(APIError) as cut:
                async for _ in dispatcher.generate(request):
                    pass
            failures = dispatcher.metrics.decode_failures._value.get()
            return cut.value.message, failures, pool.get(info.worker_id).healthy, len(
                decode.requests)  # fmt: skip
        finally:
            await pool.close()
            await server.stop(None)

    message, failures, healthy, calls = run_with_registry(tmp_path, scenario)
    assert "ran past router.request_timeout_s" in message
    assert (failures, healthy, calls) == (0, True, 1)


@pytest.mark.timeout(60)
def test_a_prefill_the_routers_deadline_cuts_blames_no_worker(tmp_path):
    """As for a decode call: the sequence's deadline ending a prefill call counted a
    prefill failure and a fallback against a healthy worker, with a warning blaming it."""
    prefill, decode = HeldPrefill(), Decode(fail=False, token_ids=(1, 2))  # never answers

    async def scenario(registry: RedisRegistry) -> tuple:
        (server_p, info_p), (server_d, _) = await serve(prefill, registry), await serve(
            decode, registry)  # fmt: skip
        config = RouterConfig(min_disagg_tokens=1, request_timeout_s=0.5)
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            request = SequenceRequest("r1", list(range(5, 60)), [], pb.SamplingParams())
            with pytest.raises(APIError) as cut:
                async for _ in dispatcher.generate(request):
                    pass
            counted = [c._value.get() for c in (dispatcher.metrics.prefill_failures,
                                                dispatcher.metrics.prefill_fallbacks)]  # fmt: skip
            return cut.value.message, *counted, pool.get(info_p.worker_id).healthy
        finally:
            await pool.close()
            await server_p.stop(None)
            await server_d.stop(None)

    message, failures, fallbacks, healthy = run_with_registry(tmp_path, scenario)
    assert "ran past router.request_timeout_s" in message
    assert (failures, fallbacks, healthy) == (0, 0, True)


@pytest.mark.timeout(60)
def test_a_sequence_another_decode_worker_takes_over_counts_ahead_there(tmp_path):
    """A decode worker fails before its first token; the next one takes the sequence. It
    stayed counted among what is ahead on the first (whose line then held new sequences
    back from that idle worker, 9 s in an audit) and not where it ran."""
    failing, streaming = Decode(fail=True), HeldDecode()

    async def scenario(registry: RedisRegistry) -> list[tuple[int, int]]:
        servers = [await serve(failing, registry), await serve(streaming, registry)]
        ids = [info.worker_id for _, info in servers]
        config = RouterConfig(min_disagg_tokens=0, decode_queue_factor=0.125)  # 1 ahead
        pool, dispatcher = pool_and_dispatcher(registry, PrefixIndex(), config)
        try:
            await refreshed(pool)
            first, second = (pool.get(worker_id) for worker_id in ids)
            prompt = list(range(5, 40))
            request = SequenceRequest("r", prompt, hash_blocks(prompt, 16), pb.SamplingParams())
            seat = _Seat(first.worker_id, await dispatcher._room_on(first, request, 3))
            placement = Placement(first.worker_id, None, 0, 0)
            decode = dispatcher._decode(request, placement, None, RemoteLease(_nothing),
                                        set(), None, seat)  # fmt: skip
            counts = []
            reading = asyncio.ensure_future(anext(decode))
            while not streaming.requests:  # the second worker has it now
                await asyncio.sleep(0.01)
            counts.append((first.ahead.num_seqs, second.ahead.num_seqs))
            streaming.finish.release()
            await reading
            await decode.aclose()
            seat.leave()
            counts.append((first.ahead.num_seqs, second.ahead.num_seqs))
            return counts
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [(0, 1), (0, 0)]
