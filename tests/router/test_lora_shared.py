"""Runtime LoRA loads and unloads shared by two routers on one Redis registry (a real
redis-server), each with its own worker pool probing the same workers over real gRPC:
an adapter loaded through one is served through the other; one unloaded through one is
withdrawn by the other and never loaded again; a worker that restarts gets the loads
back from whichever router is left; an unload its router abandoned is finished."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from common.config import LoraSettings, Role
from common.lora_intents import LoraIntentState
from common.registry import RedisRegistry, WorkerInfo
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.errors import APIError
from router.events import EventListener
from router.lora_adapters import LoraAdapters
from router.prefix_index import PrefixIndex
from router.workers import LoraRef, WorkerPool
from tests.common.redis_server import redis_server
from tests.router.test_lora_adapters import AdapterWorker

REFRESH_S = 0.2
SETTINGS = LoraSettings(runtime_loading=True)
PATH = "/adapters/alice"


class Worker(AdapterWorker, pb_grpc.DecodeServiceServicer):
    """A worker of either role as the pools see it: its Stats list the adapters it
    serves; ``restart`` loses the runtime loads, as a restarted process does."""

    def __init__(self) -> None:
        super().__init__("f1")
        self.engine_id = "e-1"

    async def Stats(self, request, context):
        adapters = [pb.LoraAdapterInfo(name=n, fingerprint=f) for n, f in self.adapters.items()]
        return pb.StatsResponse(engine_id=self.engine_id, lora_adapters=adapters)

    def restart(self) -> None:
        self.adapters.clear()
        self.engine_id += "+"


@dataclass
class Router:
    registry: RedisRegistry
    pool: WorkerPool
    adapters: LoraAdapters

    async def refresh(self) -> None:
        """One refresh of the router's loops: the pool's probes, then the reconcile."""
        await self.pool.refresh()
        await self.adapters.reconcile()

    async def close(self) -> None:
        await self.pool.close()
        self.registry.close()


def router_on(url: str) -> Router:
    registry = RedisRegistry(url, ttl_s=30.0)
    pool = WorkerPool(registry, EventListener(PrefixIndex(), threading.Lock()), REFRESH_S, 30.0)
    return Router(registry, pool, LoraAdapters(SETTINGS, pool, "base", registry, REFRESH_S))


async def serve(worker: Worker, role: Role, registry: RedisRegistry) -> grpc.aio.Server:
    """``worker`` on a free port of 127.0.0.1, registered as a ``role`` worker."""
    server = grpc.aio.server()
    pb_grpc.add_PrefillServiceServicer_to_server(worker, server)
    pb_grpc.add_DecodeServiceServicer_to_server(worker, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    registry.register(WorkerInfo(worker_id=f"{role}@127.0.0.1:{port}", role=role,
                                 grpc_address=f"127.0.0.1:{port}",
                                 events_endpoint="tcp://127.0.0.1:1",
                                 replay_endpoint="tcp://127.0.0.1:2"))  # fmt: skip
    return server


def run_routers(tmp_path, scenario):
    """``scenario(a, b, workers)``: two routers on one registry, and a prefill and a
    decode worker both probe; each router has refreshed once."""

    async def main(url: str):
        workers = [Worker(), Worker()]
        a, b = router_on(url), router_on(url)
        roles = (Role.PREFILL, Role.DECODE)
        servers = [await serve(w, role, a.registry) for w, role in zip(workers, roles, strict=True)]
        try:
            await a.refresh()
            await b.refresh()
            return await scenario(a, b, workers)
        finally:
            await a.close()
            await b.close()
            for server in servers:
                await server.stop(None)

    with redis_server(tmp_path) as url:
        return asyncio.run(main(url))


async def refused(call) -> APIError:
    with pytest.raises(APIError) as error:
        await call if asyncio.iscoroutine(call) else call()
    return error.value


@pytest.mark.timeout(60)
def test_an_adapter_loaded_through_one_router_is_served_through_the_other(tmp_path):
    async def scenario(a: Router, b: Router, workers):
        await a.adapters.load("alice", PATH)
        await b.refresh()
        ref = b.adapters.resolve("alice")
        placed = len(b.pool.candidates(Role.DECODE, ref))
        return b.adapters.names(), ref, b.adapters.path_of("alice"), placed

    assert run_routers(tmp_path, scenario) == (["alice"], LoraRef("alice", "f1"), PATH, 1)


@pytest.mark.timeout(60)
def test_an_unload_through_one_router_is_kept_by_the_other(tmp_path):
    """Loaded through B, unloaded through A: B's reconcile loaded it back onto every
    worker at its next refresh, and B kept routing it. Now B refuses it from the moment
    A starts the unload, and keeps it off the workers, one that missed it included."""

    async def scenario(a: Router, b: Router, workers):
        await b.adapters.load("alice", PATH)
        await a.refresh()
        release = a.adapters.admit("alice", 1)  # A's request of it: the unload waits
        unload = asyncio.create_task(a.adapters.unload("alice"))
        while not a.adapters.withdrawn("alice"):
            await asyncio.sleep(0.01)
        await b.refresh()
        during = (
            b.adapters.names(),
            (await refused(lambda: b.adapters.resolve("alice"))).status,
            (await refused(b.adapters.load("alice", PATH))).status,
            [dict(w.adapters) for w in workers],  # still served: A's request runs
        )
        release()
        await unload
        for _ in range(2):
            await b.refresh()
        after = [dict(w.adapters) for w in workers], b.adapters.names()
        workers[1].adapters["alice"] = "f1"  # one unreachable at the unload, back
        await b.refresh()
        return during, after, [dict(w.adapters) for w in workers], b.adapters.names()

    during, after, missed, names = run_routers(tmp_path, scenario)
    assert during == ([], 404, 400, [{"alice": "f1"}, {"alice": "f1"}])
    assert after == ([{}, {}], [])
    assert (missed, names) == ([{}, {}], [])


@pytest.mark.timeout(60)
def test_a_restarted_worker_gets_the_adapter_back_from_the_router_left(tmp_path):
    """Loaded through A, which then stops: the decode worker restarts (its runtime loads
    gone) and B alone loads it back, from the shared intent."""

    async def scenario(a: Router, b: Router, workers):
        await a.adapters.load("alice", PATH)
        await a.close()
        workers[1].restart()
        await b.refresh()
        ref = b.adapters.resolve("alice")
        return [dict(w.adapters) for w in workers], len(b.pool.candidates(Role.DECODE, ref))

    assert run_routers(tmp_path, scenario) == ([{"alice": "f1"}, {"alice": "f1"}], 1)


@pytest.mark.timeout(60)
def test_an_unload_its_router_abandoned_is_finished_by_the_other(tmp_path):
    """A stops midway through an unload (RETIRING written, the workers still serve it):
    B refuses it and loads of it, and past ``abandoned_after_s`` unloads it and writes
    the tombstone, after which it may be loaded again."""

    async def scenario(a: Router, b: Router, workers):
        await a.adapters.load("alice", PATH)
        a.adapters.admit("alice", 1)  # never released: A stops first
        unload = asyncio.create_task(a.adapters.unload("alice"))
        while not a.adapters.withdrawn("alice"):
            await asyncio.sleep(0.01)
        unload.cancel()
        await b.refresh()
        load = (await refused(b.adapters.load("alice", PATH))).message
        kept = [dict(w.adapters) for w in workers]
        since = b.adapters._retiring_since
        for key in since:  # (as if abandoned_after_s had passed)
            since[key] -= b.adapters.abandoned_after_s
        await b.refresh()
        state = b.registry.lora_intents()["alice"].state
        finished = [dict(w.adapters) for w in workers], state
        await b.adapters.load("alice", PATH)
        return load, kept, finished, [dict(w.adapters) for w in workers]

    load, kept, finished, reloaded = run_routers(tmp_path, scenario)
    assert "being unloaded" in load and kept == [{"alice": "f1"}] * 2
    assert finished == ([{}, {}], LoraIntentState.UNLOADED)
    assert reloaded == [{"alice": "f1"}] * 2
