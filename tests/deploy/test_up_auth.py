"""The internal token end to end: a ``pdserve up`` stack with ``PDSERVE_INTERNAL_TOKEN``
serves disaggregated requests (the router's calls and the decode worker's NIXL handshake
with the prefill worker carry the token), while a call to a worker without it is refused
and the health probe stays open; the launcher warns about workers reachable from other
machines without a token."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.internal_auth import TOKEN_ENV, InternalAuth, open_ports_warning
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.deploy.load import MODEL
from tests.support.processes import write_config
from tests.support.stack import start_up_stack

TOKEN = "test-internal-token"


async def prefill_calls(address: str) -> tuple[object, object, object]:
    """(Stats without the token, Stats with it, health without it)."""
    results: list[object] = []
    for auth in (InternalAuth(), InternalAuth(TOKEN)):
        async with auth.aio_channel(address) as channel:
            try:
                stats = await pb_grpc.PrefillServiceStub(channel).Stats(pb.StatsRequest(),
                                                                        timeout=5)  # fmt: skip
                results.append(stats.requests_finished)
            except grpc.aio.AioRpcError as exc:
                results.append(exc.code())
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        results.append(reply.status)
    return tuple(results)


async def decode_stats(address: str) -> pb.StatsResponse:
    async with InternalAuth(TOKEN).aio_channel(address) as channel:
        return await pb_grpc.DecodeServiceStub(channel).Stats(pb.StatsRequest(), timeout=5)


def test_a_stack_with_a_token_serves_and_its_workers_refuse_calls_without_it(tiny_llama, tmp_path):
    router = {"served_model_name": MODEL, "min_disagg_tokens": 0}
    config = write_config(tmp_path / "c.yaml", tiny_llama, router=router)
    stack = start_up_stack(config, tmp_path / "home", env={TOKEN_ENV: TOKEN})
    try:
        client = stack.openai_client()
        for _ in range(2):  # disaggregated: the decode worker pulls from the prefill worker
            reply = client.completions.create(model=MODEL, prompt="a b c d e f", max_tokens=4)
            assert reply.usage.completion_tokens == 4
        decode = asyncio.run(decode_stats(f"127.0.0.1:{stack.config['decode']['port']}"))
        assert decode.blocks_pulled > 0 and decode.transfer_failures == 0  # (none recomputed)
        address = f"127.0.0.1:{stack.config['prefill']['port']}"
        refused, finished, serving = asyncio.run(prefill_calls(address))
        assert refused == grpc.StatusCode.UNAUTHENTICATED
        assert finished == 2 and serving == health_pb2.HealthCheckResponse.SERVING
        assert "warning" not in stack.log()  # (loopback workers)
    finally:
        assert stack.stop() == 0, stack.log()


def test_workers_reachable_from_elsewhere_without_a_token_are_warned_about():
    assert open_ports_warning(["127.0.0.1", "localhost", "::1"], {}) is None
    warning = open_ports_warning(["127.0.0.1", "10.0.0.5", "decode-host"], {})
    assert warning is not None and "10.0.0.5, decode-host" in warning and TOKEN_ENV in warning
    assert open_ports_warning(["10.0.0.5"], {TOKEN_ENV: "x"}) is None


def test_the_launchers_config_file_holds_no_client_keys_and_only_its_user_reads_it(
    tmp_path, monkeypatch
):
    """The children's config file held ``router.api_keys`` in plain text, mode 0644,
    for the whole run (and after a killed launcher): the router gets them in
    ``PDSERVE_API_KEYS`` now, beside any the launcher was given."""
    from common.api_keys import API_KEYS_ENV
    from common.config_loader import load_config
    from deploy.up import Stack

    config = load_config("deploy/configs/1p1d-demo.yaml", ["router.api_keys=[sk-secret]"])
    stack = Stack(config, tmp_path)
    assert "sk-secret" not in stack.config_path.read_text()
    assert stack.config_path.stat().st_mode & 0o777 == 0o600
    assert load_config(str(stack.config_path)).router.api_keys == []
    monkeypatch.setenv(API_KEYS_ENV, "given")
    assert stack._router_env() == {API_KEYS_ENV: "given,sk-secret"}
