"""The router's worker pool: a worker that leaves the registry gets no new requests, but
the streams already on it run to their end; unless it is frozen, when they fail after the
stall timeout even though its registry entry expired first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config import Role
from common.registry import RedisRegistry, WorkerInfo
from common.router_config import RouterConfig
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.events import EventListener
from router.prefix_index import PrefixIndex, PrefixMatch
from router.workers import WorkerPool, WorkerStalled, WorkerState
from tests.common.redis_server import run_with_registry

NUM_CHUNKS = 6


class SlowDecode(pb_grpc.DecodeServiceServicer):
    async def Generate(self, request, context):
        for token in range(NUM_CHUNKS):
            await asyncio.sleep(0.05)
            yield pb.GenerateResponse(token_ids=[token])

    async def Stats(self, request, context):
        return pb.StatsResponse()


async def serve_decode(decode, health_servicer) -> tuple[grpc.aio.Server, WorkerInfo]:
    """A decode service on a free port of 127.0.0.1, and its registry entry."""
    server = grpc.aio.server()
    pb_grpc.add_DecodeServiceServicer_to_server(decode, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    info = WorkerInfo(
        worker_id=f"decode@127.0.0.1:{port}",
        role=Role.DECODE,
        grpc_address=f"127.0.0.1:{port}",
        events_endpoint="tcp://127.0.0.1:1",
        replay_endpoint="tcp://127.0.0.1:2",
    )
    return server, info


@pytest.mark.timeout(60)
def test_a_worker_leaving_the_registry_finishes_its_streams(tmp_path):
    """Say its Redis entry expired (a stalled heartbeat) or Redis lost its keys."""

    async def scenario(registry: RedisRegistry) -> list[int]:
        server, info = await serve_decode(SlowDecode(), health.aio.HealthServicer())
        registry.register(info)
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0)
        try:
            await pool.refresh()
            state = pool.get(info.worker_id)
            assert state is not None and state.healthy
            call = state.decode.Generate(pb.GenerateRequest(request_id="r1"))
            tokens = []
            async for chunk in call:
                tokens.extend(chunk.token_ids)
                if len(tokens) == 2:  # mid-stream, the worker's registry entry goes
                    registry.deregister(info.worker_id)
                    await pool.refresh()
                    assert pool.get(info.worker_id) is None
                    assert pool.candidates(Role.DECODE) == []
            return tokens
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == list(range(NUM_CHUNKS))


@pytest.mark.timeout(60)
def test_a_worker_back_in_the_registry_keeps_the_load_of_its_running_calls(tmp_path):
    """Redis lost its keys and the worker re-registered, same engine, while a stream ran
    on it: the pool keeps its state (the stream still counts in its load) and new calls
    get a channel that is not closing."""

    async def scenario(registry: RedisRegistry) -> list[int]:
        server, info = await serve_decode(SlowDecode(), health.aio.HealthServicer())
        registry.register(info)
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0)
        try:
            await pool.refresh()
            state = pool.get(info.worker_id)
            state.num_running += 1  # as the dispatcher counts a stream it starts
            call = state.decode.Generate(pb.GenerateRequest(request_id="r1"))
            tokens = []
            with state.tracking(call):
                async for chunk in call:
                    tokens.extend(chunk.token_ids)
                    if len(tokens) == 2:
                        registry.deregister(info.worker_id)  # Redis lost the keys
                        await pool.refresh()
                        assert pool.get(info.worker_id) is None
                        registry.register(info)  # the next heartbeat
                        await pool.refresh()
                        assert pool.get(info.worker_id) is state and state.num_running == 1
            state.num_running -= 1
            second = [
                t async for c in state.decode.Generate(pb.GenerateRequest()) for t in c.token_ids
            ]
            assert second == list(range(NUM_CHUNKS)) and state.num_running == 0
            # Leaving again mid-stream: the pool keeps refreshing (a closed probe channel
            # used to fail every refresh from then on).
            call = state.decode.Generate(pb.GenerateRequest(request_id="r2"))
            with state.tracking(call):
                async for _ in call:
                    registry.deregister(info.worker_id)
                    await pool.refresh()
                    await pool.refresh()
                    assert pool.get(info.worker_id) is None
            return tokens
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == list(range(NUM_CHUNKS))


@pytest.mark.timeout(60)
def test_a_registry_that_lost_its_entries_does_not_empty_the_pool(tmp_path):
    """FLUSHDB, or Redis back from an outage past the entries' TTL: workers that still
    answer stay (their next heartbeat re-registers them); a grace later, or once their
    probes fail, they go."""

    async def scenario(registry: RedisRegistry) -> None:
        server, info = await serve_decode(SlowDecode(), health.aio.HealthServicer())
        registry.register(info)
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0,
                          missing_grace_s=1.0)  # fmt: skip
        try:
            await pool.refresh()
            state = pool.get(info.worker_id)
            registry.deregister(info.worker_id)  # the keys are gone
            await pool.refresh()
            assert pool.get(info.worker_id) is state and pool.candidates(Role.DECODE)
            registry.register(info)  # its next heartbeat
            await pool.refresh()
            assert pool.get(info.worker_id) is state and state.missing_since is None
            registry.deregister(info.worker_id)  # gone for good this time
            await pool.refresh()
            await asyncio.sleep(1.1)
            await pool.refresh()
            assert pool.get(info.worker_id) is None
            registry.register(info)
            await pool.refresh()
            await server.stop(None)  # missing and not answering: goes at once
            registry.deregister(info.worker_id)
            await pool.refresh()  # its probe fails
            await pool.refresh()
            assert pool.get(info.worker_id) is None
        finally:
            await pool.close()
            await server.stop(None)

    run_with_registry(tmp_path, scenario)


@pytest.mark.timeout(60)
def test_a_worker_of_another_block_size_model_or_connector_is_not_placed_on(tmp_path, caplog):
    """A worker started with another engine.block_size (a scale-out with the wrong
    config) hashes its prefixes at other boundaries: none of the router's would ever
    match, and pulls between it and the others fail at their handshake. Another model or
    connector: two deployments under one Redis and the default key prefix shared their
    workers (each request's tokens depended on where it went; the other connector's
    decode worker refused the KV handle: a 400, and a lease pinned until it expired).
    Such a worker stays out of the pool, one error logged per engine, until it comes back
    as the router's."""
    import dataclasses

    async def scenario(registry: RedisRegistry) -> list[bool]:
        server, info = await serve_decode(SlowDecode(), health.aio.HealthServicer())
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0,
                          block_size=16, missing_grace_s=30.0, model="/models/a",
                          connector="nixl")  # fmt: skip
        ours = dataclasses.replace(info, block_size=16, model="/models/a", connector="nixl")
        seen = []

        async def registered(**changes) -> None:
            registry.register(dataclasses.replace(ours, **changes))
            await pool.refresh()
            seen.append(pool.get(info.worker_id) is not None)

        try:
            for _ in range(3):
                await registered(block_size=32)
            await registered(engine_id="fixed")
            # Restarted with the wrong size while in the pool: out at once. The grace a
            # worker missing from the registry gets (it still answered) kept its old
            # state, placed on, until registry.ttl_s passed.
            await registered(block_size=32, engine_id="wrong")
            await registered(model="/models/b", engine_id="b")
            await registered(connector="shared_storage", engine_id="ss")
            await registered(engine_id="ours")
        finally:
            await pool.close()
            await server.stop(None)
        return seen

    seen = run_with_registry(tmp_path, scenario)
    assert seen == [False, False, False, True, False, False, False, True]
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("block size 32, the router 16" in m for m in logged) == 2  # once per engine
    assert any("has model /models/b, the router /models/a" in m and "key_prefix" in m
               for m in logged), logged  # fmt: skip
    assert any("has connector shared_storage, the router nixl" in m for m in logged), logged


@pytest.mark.timeout(60)
def test_a_worker_that_refuses_the_routers_token_is_down_and_says_why(tmp_path, caplog):
    """Its health check answers (open to probes) but its Stats refuses the router's calls
    (the tokens differ): down, with one error naming the variable, not silently."""
    from common.internal_auth import TOKEN_ENV, InternalAuth

    async def scenario(registry: RedisRegistry) -> list[bool]:
        server = grpc.aio.server(interceptors=InternalAuth("theirs").server_interceptors())
        pb_grpc.add_DecodeServiceServicer_to_server(SlowDecode(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        info = WorkerInfo(worker_id=f"decode@127.0.0.1:{port}", role=Role.DECODE,
                          grpc_address=f"127.0.0.1:{port}", events_endpoint="tcp://127.0.0.1:1",
                          replay_endpoint="tcp://127.0.0.1:2")  # fmt: skip
        registry.register(info)
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0,
                          auth=InternalAuth("ours"))  # fmt: skip
        try:
            healthy = []
            for _ in range(3):
                await pool.refresh()
                healthy.append(pool.get(info.worker_id).healthy)
            return healthy
        finally:
            await pool.close()
            await server.stop(None)

    assert run_with_registry(tmp_path, scenario) == [False, False, False]
    errors = [r for r in caplog.records if "refuses this router's calls" in r.getMessage()]
    assert len(errors) == 1 and TOKEN_ENV in errors[0].getMessage()


class DrainableDecode(SlowDecode):
    def __init__(self) -> None:
        self.draining = False

    async def Stats(self, request, context):
        return pb.StatsResponse(engine_id="e1", draining=self.draining)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("draining", [True, False])
def test_a_drain_the_registry_does_not_show_is_said_as_planned(tmp_path, caplog, draining):
    """A worker goes out of service while its registry entry says nothing (a static
    registry has no draining flag, or the probe came first): its Stats tells a drain
    (INFO "draining") from a fault (WARNING "down"). It was WARNING "down" for both."""

    async def scenario(registry: RedisRegistry) -> list[bool]:
        decode, health_servicer = DrainableDecode(), health.aio.HealthServicer()
        server, info = await serve_decode(decode, health_servicer)
        registry.register(info)
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0)
        try:
            await pool.refresh()
            healthy = [pool.get(info.worker_id).healthy]
            decode.draining = draining
            await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await pool.refresh()
            return healthy + [pool.get(info.worker_id).healthy]
        finally:
            await pool.close()
            await server.stop(None)

    with caplog.at_level(logging.INFO, logger="router"):
        assert run_with_registry(tmp_path, scenario) == [True, False]
    said = [(r.levelno, r.getMessage().rsplit(" ", 1)[1]) for r in caplog.records
            if r.getMessage().startswith("worker decode@")]  # fmt: skip
    assert said[-1] == ((logging.INFO, "draining") if draining else (logging.WARNING, "down"))


@pytest.mark.timeout(60)
def test_a_worker_never_reached_since_it_joined_is_said_once(tmp_path, caplog):
    """A registry entry whose address accepts connections and never answers (a wrong
    advertised address, a firewall dropping replies): the worker started down, so it
    never went down, and nothing was logged while it was skipped. Now one warning naming
    the address, after the stall timeout; none for a worker that answers."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])  # and never a byte back

    threading.Thread(target=accept, daemon=True).start()

    async def scenario(registry: RedisRegistry) -> None:
        server, answering = await serve_decode(SlowDecode(), health.aio.HealthServicer())
        silent = WorkerInfo(worker_id=f"decode@127.0.0.1:{port}", role=Role.DECODE,
                            grpc_address=f"127.0.0.1:{port}",
                            events_endpoint="tcp://127.0.0.1:1",
                            replay_endpoint="tcp://127.0.0.1:2")  # fmt: skip
        registry.register(answering)
        registry.register(silent)
        pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), 60.0, 30.0,
                          stall_timeout_s=1.5)  # fmt: skip
        try:
            for _ in range(4):  # a probe each: up to its 1 s timeout
                await pool.refresh()
        finally:
            await pool.close()
            await server.stop(None)

    try:
        run_with_registry(tmp_path, scenario)
    finally:
        listener.close()
        for connection in held:
            connection.close()
    said = [r for r in caplog.records if "has not answered since it joined" in r.getMessage()]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0].getMessage(), said
    assert said[0].levelno == logging.WARNING


def test_the_load_placement_sees_counts_other_routers_work():
    """Several routers share the workers: a worker's load is this router's own count or
    its last Stats, whichever is more, plus what this router placed on its way. Counting
    only its own, each router saw a worker others had filled as idle."""
    from router.policy import PlacementPolicy

    def decode_state(worker_id: str, **stats) -> WorkerState:
        info = WorkerInfo(worker_id=worker_id, role=Role.DECODE, grpc_address="127.0.0.1:1",
                          events_endpoint="tcp://127.0.0.1:1",
                          replay_endpoint="tcp://127.0.0.1:2")  # fmt: skip
        state = WorkerState(info, None, None, None, None)  # type: ignore[arg-type]
        state.stats = pb.StatsResponse(kv_blocks_total=1000, **stats)
        return state

    busy = decode_state("d0", num_running=60, num_waiting=4, kv_blocks_used=990)
    idle = decode_state("d1")
    load = busy.load()
    assert (load.num_running, load.kv_blocks_in_use) == (64, 990)
    busy.num_running, busy.assigned, busy.assigned_blocks = 70, 2, 5  # its own count is ahead
    assert (busy.load().num_running, busy.load().kv_blocks_in_use) == (72, 995)
    prefill = decode_state("p0", queued_prefill_tokens=200_000)
    assert prefill.load().queued_prefill_tokens == 200_000
    # A prefix the busy worker holds no longer draws every request to it.
    policy = PlacementPolicy(RouterConfig(), block_size=16, max_running=64)
    placed = policy.place(1000, [busy.load(), idle.load()], [], {"d0": PrefixMatch(1, 0)}, {})
    assert placed.decode_worker == "d1"


class FreezableDecode(pb_grpc.DecodeServiceServicer):
    """Streams a token every 50 ms, and answers health checks, until frozen: then neither
    (a stopped process or a hung host looks the same from the router)."""

    def __init__(self) -> None:
        self.frozen = asyncio.Event()

    async def Generate(self, request, context):
        for token in range(1000):
            await asyncio.sleep(0.05)
            if self.frozen.is_set():
                await asyncio.sleep(3600)
            yield pb.GenerateResponse(token_ids=[token])

    async def Stats(self, request, context):
        return pb.StatsResponse()


class FreezableHealth(health.aio.HealthServicer):
    def __init__(self, frozen: asyncio.Event) -> None:
        super().__init__()
        self.frozen = frozen

    async def Check(self, request, context):
        if self.frozen.is_set():
            await asyncio.sleep(3600)
        return await super().Check(request, context)


async def seconds_to_fail_a_frozen_stream(
    registry: RedisRegistry, refresh_s: float, stall_timeout_s: float, expire_entry: bool
) -> float:
    """Freeze a decode worker mid-stream (and expire its registry entry if asked); the
    seconds until the pool fails the stream. Also checks the failure came no sooner than
    ``stall_timeout_s`` after the worker's last answer."""
    decode = FreezableDecode()
    server, info = await serve_decode(decode, FreezableHealth(decode.frozen))
    registry.register(info)
    pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), refresh_s,
                      600.0, stall_timeout_s=stall_timeout_s)  # fmt: skip
    await pool.start()
    try:
        state = pool.get(info.worker_id)
        call = state.decode.Generate(pb.GenerateRequest(request_id="r1"))
        frozen_at = None
        with pytest.raises(WorkerStalled), state.tracking(call):
            async for _ in call:
                if frozen_at is None:
                    decode.frozen.set()
                    if expire_entry:
                        registry.deregister(info.worker_id)
                    frozen_at = time.monotonic()
        failed_at = time.monotonic()
        assert failed_at - state.answered_at >= stall_timeout_s
        return failed_at - frozen_at
    finally:
        decode.frozen.clear()
        await pool.close()
        await server.stop(None)


@pytest.mark.timeout(60)
def test_a_frozen_worker_whose_entry_expired_still_has_its_calls_failed(tmp_path):
    """A frozen worker stops heartbeating, so with Redis its entry expires (ttl) before
    the stall timeout; the pool must still fail the calls left on it, not let them hang
    until the request timeout."""

    async def scenario(registry: RedisRegistry) -> float:
        return await seconds_to_fail_a_frozen_stream(registry, 0.2, 1.0, expire_entry=True)

    assert run_with_registry(tmp_path, scenario) < 10


@pytest.mark.timeout(60)
def test_a_frozen_worker_is_given_up_about_the_stall_timeout_after_it_froze(tmp_path):
    """With probes every 1 s taking up to 1 s each, a worker frozen just after answering
    is failed at the first tick at least the 2 s stall timeout after its last answer:
    3.0 s in practice, as the freeze lands just after a tick. The silence counts from its
    last answer, and probes keep their cadence while one waits out its timeout. (Counting
    from the first miss and sleeping after each refresh took 4-4.7 s; the bound leaves a
    late tick 0.8 s on a loaded box.)"""
    refresh_s, stall_timeout_s = 1.0, 2.0

    async def scenario(registry: RedisRegistry) -> float:
        return await seconds_to_fail_a_frozen_stream(
            registry, refresh_s, stall_timeout_s, expire_entry=False
        )

    assert run_with_registry(tmp_path, scenario) < stall_timeout_s + refresh_s + 0.8
