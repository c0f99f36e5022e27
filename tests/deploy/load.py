"""Streaming load through the router for drain and scaling tests: a few clients send
streaming completions back to back until stopped, and every request that does not end
with all its tokens is recorded as a failure."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.internal_auth import InternalAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

MODEL = "tiny"


@dataclass
class LoadResult:
    completed: int = 0
    failures: list[str] = field(default_factory=list)


class StreamingLoad:
    """``concurrency`` clients, each streaming one completion after another: prompts of
    random token ids (long enough to be disaggregated when ``router.min_disagg_tokens`` is
    0) and exactly ``num_tokens`` generated tokens (``min_tokens`` forbids an early EOS)."""

    def __init__(self, base_url: str, concurrency: int = 3, num_tokens: int = 48) -> None:
        self.base_url = base_url
        self.concurrency = concurrency
        self.num_tokens = num_tokens
        self.result = LoadResult()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0)
        self._tasks = [
            asyncio.create_task(self._client(client, seed)) for seed in range(self.concurrency)
        ]

    async def stop(self) -> LoadResult:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.result

    async def wait_completed(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.result.completed < count:
            assert not self.result.failures, self.result.failures
            assert asyncio.get_running_loop().time() < deadline, "the load made no progress"
            await asyncio.sleep(0.1)

    async def _client(self, client: openai.AsyncOpenAI, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = [rng.randrange(5, 2000) for _ in range(rng.randrange(40, 120))]
            try:
                tokens, reason = await self._one(client, prompt)
            except Exception as exc:  # any error is a failed request
                self.result.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            if (tokens, reason) != (self.num_tokens, "length"):
                self.result.failures.append(f"ended after {tokens} tokens ({reason})")
            else:
                self.result.completed += 1

    async def _one(self, client: openai.AsyncOpenAI, prompt: list[int]) -> tuple[int, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=self.num_tokens, temperature=0, stream=True,
            extra_body={"min_tokens": self.num_tokens, "return_token_ids": True}, timeout=60,
        )  # fmt: skip
        tokens, reason = 0, ""
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len(choice.model_extra.get("token_ids") or [])
                reason = choice.finish_reason or reason
        return tokens, reason


async def worker_stats(address: str, role: str) -> pb.StatsResponse:
    async with InternalAuth.from_env().aio_channel(address) as channel:
        stub_type = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
        return await stub_type(channel).Stats(pb.StatsRequest(), timeout=5)


async def wait_serving_requests(address: str, role: str, timeout_s: float = 60.0) -> None:
    """Until the worker has finished a request: the router sends it work."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await worker_stats(address, role)).requests_finished == 0:
        assert asyncio.get_running_loop().time() < deadline, f"no request reached {address}"
        await asyncio.sleep(0.2)


async def wait_busy(address: str, role: str, timeout_s: float = 60.0) -> None:
    """Until the worker has a request in flight (so a drain has something to finish)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await worker_stats(address, role)
        if stats.num_running + stats.live_leases > 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{address} never got busy"
        await asyncio.sleep(0.02)


async def wait_health(address: str, status: int, timeout_s: float = 30.0) -> None:
    """Until the worker's gRPC health check answers ``status`` (a drain has begun: NOT_SERVING)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != status:
            assert asyncio.get_running_loop().time() < deadline, f"{address} never got {status}"
            await asyncio.sleep(0.02)
