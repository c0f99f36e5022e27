"""Workers under failure: a prefill worker dies after answering, Redis registration and
expiry after SIGKILL, an unreachable Redis, SIGTERM drain with requests in flight, and a
drain that arrives while the model is still loading."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import Role
from common.config_loader import load_config
from common.registry import RedisRegistry
from decode_service.servicer import DecodeServicer
from engine import LLM, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.common.redis_server import free_port, redis_server
from tests.deploy.load import wait_busy, wait_health
from tests.engine.helpers import random_prompts
from tests.support.pd_client import PDClient
from tests.support.processes import (
    ROOT,
    WorkerProcess,
    start_workers,
    write_config,
)
from worker.runtime import WorkerRuntime

GREEDY = pb.SamplingParams(max_tokens=12, min_tokens=12, temperature=0)


def offline_tokens(model, prompts) -> list[list[int]]:
    llm = LLM(model)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_prefill_killed_after_answering(tiny_llama, tmp_path):
    """Recompute: identical tokens from the decode worker alone. Fail: a clear error, and
    nothing held on the decode worker either way."""
    config = write_config(tmp_path / "c.yaml", tiny_llama, num_decode=2)
    prefill = WorkerProcess("prefill", 0, config, tmp_path / "p.log")
    recompute = WorkerProcess("decode", 0, config, tmp_path / "d0.log")
    fail = WorkerProcess(
        "decode", 1, config, tmp_path / "d1.log", ["kv_transfer.failure_policy=fail"]
    )
    start_workers([prefill, recompute, fail])
    prompts = random_prompts((45, 70), seed=61)
    expected = offline_tokens(tiny_llama, prompts)

    async def body():
        prefill_stub = pb_grpc.PrefillServiceStub(grpc.aio.insecure_channel(prefill.address))
        firsts = [
            await prefill_stub.Prefill(
                pb.PrefillRequest(request_id=f"k{i}", token_ids=p, sampling=GREEDY), timeout=30
            )
            for i, p in enumerate(prompts)
        ]
        prefill.proc.kill()
        prefill.proc.wait()
        results = []
        for worker, prompt, first in zip((recompute, fail), prompts, firsts, strict=True):
            channel = grpc.aio.insecure_channel(worker.address)
            decode = pb_grpc.DecodeServiceStub(channel)
            request = pb.GenerateRequest(
                request_id="after-kill",
                prompt_token_ids=prompt,
                output_token_ids=[first.first_token_id],
                sampling=GREEDY,
                kv=first.kv,
            )
            tokens = [first.first_token_id]
            try:
                async for chunk in decode.Generate(request, timeout=30):
                    tokens.extend(chunk.token_ids)
                results.append(tokens)
            except grpc.aio.AioRpcError as exc:
                results.append(exc)
            stats = await decode.Stats(pb.StatsRequest(), timeout=5)
            assert stats.kv_blocks_used == 0 and stats.num_running + stats.num_waiting == 0
            assert stats.transfer_failures == 1
            await channel.close()
        return results

    try:
        recomputed, failed = asyncio.run(body())
        assert recomputed == expected[0]
        assert isinstance(failed, grpc.aio.AioRpcError)
        assert failed.code() == grpc.StatusCode.ABORTED  # the worker is fine
        assert "pulling the prompt's KV" in failed.details()
    finally:
        codes = [w.stop() for w in (recompute, fail)]
    assert codes == [0, 0]


def test_redis_registration_expiry_and_drain(tiny_llama, tmp_path):
    """Workers register in a real redis-server; a SIGKILLed one vanishes after the TTL; a
    SIGTERMed one finishes its stream, refuses new work, deregisters and exits 0."""
    with redis_server(tmp_path) as url:
        registry_section = {"redis_url": url, "ttl_s": 2.0, "heartbeat_s": 0.5}
        config = write_config(tmp_path / "c.yaml", tiny_llama, registry=registry_section)
        prefill = WorkerProcess("prefill", 0, config, tmp_path / "p.log")
        decode = WorkerProcess("decode", 0, config, tmp_path / "d.log")
        start_workers([prefill, decode])
        registry = RedisRegistry(url, ttl_s=2.0)
        try:
            listed = {w.role: w for w in registry.list_workers()}
            assert listed[Role.PREFILL].grpc_address == prefill.address
            assert listed[Role.DECODE].kv_blocks_total > 0 and not listed[Role.DECODE].draining

            # Drain: a long stream in flight survives SIGTERM; new requests are refused.
            prompt = random_prompts((30,), seed=71)[0]
            long = pb.SamplingParams(max_tokens=150, min_tokens=150, temperature=0)

            async def drain_under_load():
                client = PDClient(prefill.address, decode.address)
                stream = asyncio.create_task(client.generate("long", prompt, long))
                await wait_busy(decode.address, "decode")  # the stream reached decode
                decode.signal(signal.SIGTERM)
                await wait_health(decode.address, health_pb2.HealthCheckResponse.NOT_SERVING)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.generate("late", prompt, GREEDY)
                result = await stream
                await client.close()
                return result, refused.value

            result, refused = asyncio.run(drain_under_load())
            assert len(result.token_ids) == 150 and result.finish_reason == "length"
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert decode.proc.wait(30) == 0
            assert [w.role for w in registry.list_workers()] == [Role.PREFILL]

            # SIGKILL: no deregistration, the entry expires with its TTL.
            prefill.proc.kill()
            prefill.proc.wait()
            assert registry.list_workers()
            time.sleep(2.5)
            assert registry.list_workers() == []
        finally:
            for worker in (prefill, decode):
                worker.stop(5)
            registry.close()


def test_unreachable_redis_fails_fast_with_a_clear_error(tiny_llama, tmp_path):
    registry_section = {"redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    config = write_config(tmp_path / "c.yaml", tiny_llama, registry=registry_section)
    result = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "prefill", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "cannot reach the Redis registry" in result.stderr


def test_a_drain_while_the_model_loads_never_serves_and_releases_everything(tiny_llama, tmp_path):
    """SIGTERM during model load (here: drain while the real load is held at a gate) must
    not let the worker turn SERVING afterwards with its engine thread, connector and event
    sockets left running."""
    config = load_config(str(write_config(tmp_path / "c.yaml", tiny_llama)))
    runtime = WorkerRuntime(config, Role.DECODE, 0)
    servicer = DecodeServicer(runtime)
    loading, release = threading.Event(), threading.Event()
    build = runtime._build_engine

    def gated_build() -> None:
        loading.set()
        release.wait(30)
        build()

    runtime._build_engine = gated_build

    async def health() -> int:
        async with grpc.aio.insecure_channel(runtime.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status

    async def body() -> tuple[bool, int]:
        add = lambda server: pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)  # noqa: E731
        start = asyncio.create_task(runtime.start(add))
        await asyncio.to_thread(loading.wait, 30)
        drain = asyncio.create_task(runtime.drain(servicer.in_flight))
        await asyncio.sleep(0.2)
        status_while_loading = await health()
        release.set()
        started = await asyncio.wait_for(start, 60)
        await asyncio.wait_for(drain, 30)
        return started, status_while_loading

    started, status_while_loading = asyncio.run(body())
    assert status_while_loading == health_pb2.HealthCheckResponse.NOT_SERVING
    assert started is False and not runtime.ready
    assert runtime.async_engine is not None, "the gate let the real load run to its end"
    assert not runtime.async_engine._thread.is_alive()
    ports = runtime.ports
    held = [p for p in (ports.grpc, ports.events, ports.replay, ports.kv_transfer) if listened(p)]
    assert not held, f"ports still listened on after the drain: {held}"


def listened(port: int, within_s: float = 3.0) -> bool:
    """Whether something still listens on ``port`` ``within_s`` after the drain returned.

    It binds as the servers do, with SO_REUSEADDR, so a connection of the health check left
    in TIME_WAIT (which a plain bind refuses, and a restarted worker does not mind) is not
    mistaken for a listener; a listening socket still refuses it. The short deadline lets a
    socket whose close is already under way finish on a busy machine."""
    deadline = time.monotonic() + within_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                return False
            except OSError:
                if time.monotonic() > deadline:
                    return True
        time.sleep(0.05)


@pytest.mark.parametrize("failure", ["raises", "hangs"])
def test_a_failed_engine_fails_its_streams_and_the_worker_exits_to_be_restarted(
    tiny_llama, tmp_path, failure
):
    """A step that raises (a bug, the device out of memory), or that runs past
    engine.step_timeout_s (a hung device, while health still answers from the gRPC
    thread), ends the open stream with UNAVAILABLE; the worker then deregisters, stops
    and reports exit code 1, so its launcher, compose or Kubernetes starts a fresh one."""
    config = load_config(
        str(write_config(tmp_path / "c.yaml", tiny_llama)), ["engine.step_timeout_s=1"]
    )
    runtime = WorkerRuntime(config, Role.DECODE, 0)
    servicer = DecodeServicer(runtime)

    async def body() -> grpc.aio.AioRpcError:
        add = lambda server: pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)  # noqa: E731
        assert await runtime.start(add)
        engine = runtime.async_engine.engine
        real_step, steps = engine.step, [0]

        def failing_step():
            steps[0] += 1
            if steps[0] == 3 and failure == "raises":
                raise RuntimeError("injected step failure")
            if steps[0] == 3:
                time.sleep(4)  # releases the GIL, as a stuck device sync would
            return real_step()

        engine.step = failing_step
        async with grpc.aio.insecure_channel(runtime.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            request = pb.GenerateRequest(request_id="r", prompt_token_ids=list(range(5, 40)),
                                         sampling=GREEDY)  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.Generate(request, timeout=30):
                    pass
        await asyncio.wait_for(runtime.wait_stopped(), 15)
        return failed.value

    failed = asyncio.run(body())
    expected = "injected" if failure == "raises" else "device hung"
    assert failed.code() == grpc.StatusCode.UNAVAILABLE and expected in failed.details()
    assert runtime.exit_code == 1 and not runtime.async_engine._thread.is_alive()
    assert not listened(runtime.ports.grpc)


def test_a_heartbeat_running_when_the_worker_stops_does_not_bring_its_entry_back(
    tiny_llama, tmp_path
):
    """The heartbeat ran in a thread that a cancel does not stop: one still running when
    ``stop`` deregistered found the entry gone and registered it again (a draining
    entry listed for one TTL). Registry calls now run in order on one thread."""
    config = load_config(
        str(write_config(tmp_path / "c.yaml", tiny_llama)), ["registry.heartbeat_s=0.05"]
    )
    runtime = WorkerRuntime(config, Role.DECODE, 0)
    servicer = DecodeServicer(runtime)
    calls: list[str] = []
    in_heartbeat = threading.Event()

    class SlowBeats:
        """The worker's registry, with a heartbeat that takes a while (a slow Redis)."""

        def __init__(self, registry) -> None:
            self.registry, self.listed = registry, True

        def heartbeat(self, info) -> None:
            in_heartbeat.set()
            time.sleep(0.5)
            if not self.listed:  # what Redis's heartbeat does: re-create a missing entry
                calls.append("registered again")
            calls.append("heartbeat")

        def deregister(self, worker_id: str) -> None:
            self.listed = False
            calls.append("deregister")

        def __getattr__(self, name):
            return getattr(self.registry, name)

    async def body() -> None:
        add = lambda server: pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)  # noqa: E731
        assert await runtime.start(add)
        runtime.registry = SlowBeats(runtime.registry)
        await asyncio.to_thread(in_heartbeat.wait, 10)
        await runtime.stop()

    asyncio.run(body())
    assert calls == ["heartbeat", "deregister"], calls
