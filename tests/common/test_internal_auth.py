"""The internal token on real gRPC servers and channels: a call without it (or with
another) is refused UNAUTHENTICATED, unary and streaming alike; the router's (aio) and a
peer's (sync) channels carry it; the health service stays open for probes; no token, no
check."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config_base import ConfigError
from common.internal_auth import TOKEN_ENV, InternalAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


class Decode(pb_grpc.DecodeServiceServicer):
    async def Stats(self, request, context):
        return pb.StatsResponse(num_running=3)

    async def Generate(self, request, context):
        for token_id in (5, 6):
            yield pb.GenerateResponse(token_ids=[token_id])


async def serve(auth: InternalAuth) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=auth.server_interceptors())
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
