"""The internal token on real gRPC servers and channels: a call without it (or with
another) is refused UNAUTHENTICATED, unary and streaming alike; the router's (aio) and a
peer's (sync) channels carry it; the health service stays open for probes; no token, no
check."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config_base import ConfigError
from common.internal_auth import TOKEN_ENV, InternalAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.support.processes import ROOT


class Decode(pb_grpc.DecodeServiceServicer):
    async def Stats(self, request, context):
        return pb.StatsResponse(num_running=3)

    async def Generate(self, request, context):
        for token_id in (5, 6):
            yield pb.GenerateResponse(token_ids=[token_id])


async def serve(auth: InternalAuth, receive_limit: int = -1) -> tuple[grpc.aio.Server, str]:
    """A decode servicer behind ``auth`` on a free port (``receive_limit``: the largest
    request it takes, as a worker's 64 MiB; -1: gRPC's default of 4 MiB)."""
    options = [("grpc.max_receive_message_length", receive_limit)] if receive_limit > 0 else []
    server = grpc.aio.server(interceptors=auth.server_interceptors(), options=options)
    pb_grpc.add_DecodeServiceServicer_to_server(Decode(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def outcomes(channel: grpc.aio.Channel) -> tuple[object, object, object]:
    """(Stats, Generate, Health) through ``channel``: a reply or the refusal's code."""
    stub = pb_grpc.DecodeServiceStub(channel)
    results = []
    for call in (
        lambda: stub.Stats(pb.StatsRequest(), timeout=5),
        lambda: _tokens(stub.Generate(pb.GenerateRequest(), timeout=5)),
        lambda: health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5),
    ):  # fmt: skip
        try:
            reply = await call()
            results.append(getattr(reply, "num_running", None) or getattr(reply, "status", reply))
        except grpc.aio.AioRpcError as exc:
            results.append(exc.code())
    return tuple(results)


async def _tokens(call) -> list[int]:
    return [t for reply in [r async for r in call] for t in reply.token_ids]


def test_calls_without_the_token_are_refused_but_health_checks():
    secret = InternalAuth("s3cret")
    refused = grpc.StatusCode.UNAUTHENTICATED
    serving = health_pb2.HealthCheckResponse.SERVING

    async def scenario():
        server, address = await serve(secret)
        try:
            results = {}
            for name, auth in (("none", InternalAuth()), ("wrong", InternalAuth("s3cre")),
                               ("right", secret)):  # fmt: skip
                async with auth.aio_channel(address) as channel:
                    results[name] = await outcomes(channel)
            # A peer's channel (sync, from a connector's thread), as ``PeerMetadataClient``'s.
            sync = {}
            for name, auth in (("none", InternalAuth()), ("right", secret)):
                channel = auth.channel(address)
                try:
                    reply = await asyncio.to_thread(
                        pb_grpc.DecodeServiceStub(channel).Stats, pb.StatsRequest(), timeout=5
                    )
                    sync[name] = reply.num_running
                except grpc.RpcError as exc:
                    sync[name] = exc.code()
                finally:
                    channel.close()
            return results, sync
        finally:
            await server.stop(None)

    results, sync = asyncio.run(scenario())
    assert results["none"] == results["wrong"] == (refused, refused, serving)
    assert results["right"] == (3, [5, 6], serving)
    assert sync == {"none": refused, "right": 3}


def test_no_token_no_check():
    async def scenario():
        server, address = await serve(InternalAuth())
        try:
            async with InternalAuth("any").aio_channel(address) as channel:
                with_token = await outcomes(channel)
            async with InternalAuth().aio_channel(address) as channel:
                return with_token, await outcomes(channel)
        finally:
            await server.stop(None)

    with_token, without = asyncio.run(scenario())
    assert with_token == without == (3, [5, 6], health_pb2.HealthCheckResponse.SERVING)
    assert InternalAuth().server_interceptors() == []


@pytest.mark.parametrize("value", ["", "tok"])
def test_the_token_comes_from_the_environment(value):
    assert InternalAuth.from_env({TOKEN_ENV: value} if value else {}).token == value
    # A Secret made --from-file ends with a newline: a header cannot carry it, and every
    # call failed with "invalid metadata", health checks too.
    assert InternalAuth.from_env({TOKEN_ENV: f" {value}\n"}).token == value


@pytest.mark.parametrize("value", ["a b", "tök", "a\tb"])
def test_a_token_a_header_cannot_carry_is_refused_at_start(value):
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        InternalAuth.from_env({TOKEN_ENV: value})


_SERVER = """
import asyncio
from common.internal_auth import InternalAuth
from tests.common.test_internal_auth import serve

async def main():
    server, address = await serve(InternalAuth("s3cret"), receive_limit=64 << 20)
    print(address, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _rss_mib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
        // 1024
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_refused_call_is_refused_before_its_request_is_read():
    """A caller without the token sending large requests: the refusal ran once the whole
    request was in (up to the 64 MiB message limit), so 32 such calls at once grew a
    worker by 2.3 GB. Now it runs on the call's headers: 8 calls of 32 MiB to a server
    taking 64 MiB requests (a worker's limit) grow it by little, and each is refused."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        address = server.stdout.readline().strip()
        before = peak = _rss_mib(server.pid)
        payload = b"\x0a" + b"\xff" * (32 << 20)
        codes: list[object] = []

        def call() -> None:
            options = [("grpc.max_send_message_length", -1)]
            with grpc.insecure_channel(address, options=options) as channel:
                stats = channel.unary_unary("/pdserve.v1.DecodeService/Stats")
                try:
                    stats(payload, timeout=30)
                except grpc.RpcError as exc:
                    codes.append(exc.code())

        threads = [threading.Thread(target=call) for _ in range(8)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            peak = max(peak, _rss_mib(server.pid))
            time.sleep(0.02)
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
        assert peak - before < 64, (before, peak)
    finally:
        server.kill()
        server.wait()
