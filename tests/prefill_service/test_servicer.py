"""The Prefill RPC cancelled at its worst moments leaves nothing held: the engine finished
the prompt and kept its blocks for a decode worker, and the lease may or may not have been
granted, but no reply left, so nobody would ever pull or release them."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

from common.config import TracingConfig
from common.engine_config import EngineConfig
from common.tracing import Tracer
from engine import LLMEngine
from engine.async_engine import AsyncEngine
from kv_transfer import KVTransferConfig, create_connector
from prefill_service.servicer import PrefillServicer
from proto import pdserve_pb2 as pb
from worker.stats import StageTimer

LEASE_S = 30.0


def _servicer(model) -> tuple[LLMEngine, AsyncEngine, object, PrefillServicer]:
    """A prefill servicer over a real engine and NIXL connector (an export stays open
    until a peer pulls; shared storage ends it once written), its engine stepping slowly
    (a busy engine: wide windows): (engine, async engine, connector, servicer)."""
    engine = LLMEngine(model, EngineConfig(max_model_len=256, num_blocks=64))
    async_engine = AsyncEngine(engine)
    connector = create_connector(KVTransferConfig(connector="nixl"), "prefill-0")
    connector.register_kv_caches(engine.runner.kv_caches)
    runtime = types.SimpleNamespace(  # the parts of a WorkerRuntime the servicer uses
        config=types.SimpleNamespace(kv_transfer=types.SimpleNamespace(lease_s=LEASE_S,
                                                                       connector="nixl")),
        check_accepting=lambda: async_engine, check_ready=lambda: async_engine,
        timer=StageTimer(), connector=connector, engine_id="prefill-0",
        address="127.0.0.1:1", async_engine=async_engine, model_namespace="m",
        tracer=Tracer(TracingConfig(), "pdserve-prefill"),
    )  # fmt: skip
    servicer = PrefillServicer(runtime)
    async_engine.hooks.append(servicer.engine_hook)
    async_engine.hooks.append(lambda: time.sleep(0.1))
    return engine, async_engine, connector, servicer


def _run_holding_nothing(scenario, engine, async_engine, connector, servicer) -> None:
    """Run ``scenario()``; then no lease and no held block is left, whatever it did."""
    try:
        asyncio.run(scenario())
        assert len(servicer.leases) == 0 and engine.scheduler.held == {}
    finally:
        async_engine.stop()
        connector.close()


@pytest.mark.timeout(60)
def test_a_lease_says_how_long_after_the_call_arrived_it_ends(tiny_llama):
    """On the worker's monotonic clock (``lease_ttl_s``): the router times the pull's
    start from it (wall clocks of two hosts 25 s apart pulled reused blocks). The lease
    is granted after the call arrived: it ends at least ``lease_s`` after that."""
    engine, async_engine, connector, servicer = _servicer(tiny_llama)

    async def scenario() -> None:
        async_engine.start()
        sampling = pb.SamplingParams(max_tokens=8, temperature=0)
        request = pb.PrefillRequest(request_id="p1", token_ids=[*range(5, 45)], sampling=sampling)
        started = time.monotonic()
        reply = await servicer.Prefill(request, types.SimpleNamespace())
        took_s = time.monotonic() - started
        assert took_s > 0.1 and LEASE_S <= reply.kv.lease_ttl_s <= LEASE_S + took_s
        release = pb.ReleaseKVRequest(lease_id=reply.kv.lease_id)
        assert (await servicer.ReleaseKV(release, types.SimpleNamespace())).released
        await asyncio.sleep(0.3)

    _run_holding_nothing(scenario, engine, async_engine, connector, servicer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancel_after_s", [0.0, 0.05, 0.2, "in_export"])
def test_a_cancelled_prefill_holds_no_blocks(tiny_llama, cancel_after_s):
    engine, async_engine, connector, servicer = _servicer(tiny_llama)
    exporting = threading.Event()
    export = servicer._export

    def slow_export(*args):  # the lease is granted while the handler is cancelled
        exporting.set()
        time.sleep(0.2)
        return export(*args)

    servicer._export = slow_export

    async def scenario() -> None:
        async_engine.start()
        sampling = pb.SamplingParams(max_tokens=8, temperature=0)
        request = pb.PrefillRequest(request_id="p1", token_ids=[*range(5, 45)], sampling=sampling)
        task = asyncio.create_task(servicer.Prefill(request, types.SimpleNamespace()))
        while "p1" not in engine.scheduler.held and not task.done():
            await asyncio.sleep(0.002)  # the prompt is done and its blocks are held
        if cancel_after_s == "in_export":
            while not exporting.is_set():
                await asyncio.sleep(0.002)
        else:
            await asyncio.sleep(cancel_after_s)
        replied = task.done()
        task.cancel()  # the router's deadline, or its client gone
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.5)
        if replied:  # too late to cancel: the reply's lease owns the blocks
            assert len(servicer.leases) == 1 and "p1" in engine.scheduler.held
            release = pb.ReleaseKVRequest(lease_id=task.result().kv.lease_id)
            assert (await servicer.ReleaseKV(release, types.SimpleNamespace())).released

    _run_holding_nothing(scenario, engine, async_engine, connector, servicer)
