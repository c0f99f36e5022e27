"""The Prefill RPC cancelled at its worst moments leaves nothing held: the engine finished
the prompt and kept its blocks for a decode worker, but no lease was granted yet."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from common.config import EngineConfig
from engine import LLMEngine
from engine.async_engine import AsyncEngine
from kv_transfer import KVTransferConfig, create_connector
from prefill_service.servicer import PrefillServicer
from proto import pdserve_pb2 as pb
from worker.stats import StageTimer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancel_after_s", [0.0, 0.05, 0.2])
def test_a_cancelled_prefill_holds_no_blocks(tiny_llama, tmp_path, cancel_after_s):
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=256, num_blocks=64))
    async_engine = AsyncEngine(engine)
    connector = create_connector(
        KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path)), "prefill-0"
    )
    connector.register_kv_caches(engine.runner.kv_caches)
    runtime = types.SimpleNamespace(  # the parts of a WorkerRuntime the servicer uses
        config=types.SimpleNamespace(kv_transfer=types.SimpleNamespace(lease_s=30.0,
                                                                       connector="shared_storage")),
        check_accepting=lambda: async_engine, check_ready=lambda: async_engine,
        timer=StageTimer(), connector=connector, engine_id="prefill-0",
        address="127.0.0.1:1", async_engine=async_engine,
    )  # fmt: skip
    servicer = PrefillServicer(runtime)
    async_engine.hooks.append(servicer.engine_hook)
    async_engine.hooks.append(lambda: time.sleep(0.1))  # a busy engine: wide windows

    async def scenario() -> None:
        async_engine.start()
        sampling = pb.SamplingParams(max_tokens=8, temperature=0)
        request = pb.PrefillRequest(request_id="p1", token_ids=[*range(5, 45)], sampling=sampling)
        task = asyncio.create_task(servicer.Prefill(request, types.SimpleNamespace()))
        while "p1" not in engine.scheduler.held and not task.done():
            await asyncio.sleep(0.002)  # the prompt is done and its blocks are held
        await asyncio.sleep(cancel_after_s)
        task.cancel()  # the router's deadline, or its client gone
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.5)

    try:
        asyncio.run(scenario())
        # Either no lease and nothing held, or a lease that still owns the blocks.
        leased = {lease.request_id for lease in servicer.leases._leases.values()}
        leaked = [rid for rid in engine.scheduler.held if rid not in leased]
        assert leaked == []
    finally:
        async_engine.stop()
        connector.close()
