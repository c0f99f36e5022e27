"""Priority scheduling through a real ``pdserve up`` stack (router + 1 prefill + 1 decode
worker, ``engine.scheduling_policy: priority``, one decode batch slot): a request of a
smaller priority value arriving while a long one decodes gets the slot at once (the long
one is preempted and recomputes), finishes first, and neither sequence's tokens change.
Under FCFS the short one would wait for the whole long one: the test would fail. And
``pdserve bench --priority-mix`` reports each class against such a stack. Last, the
stack stops (no drain grace) with a stream running: the stream ends with an error event
and ``[DONE]`` (it was cut: httpx's "incomplete chunked read")."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from benchmarks.loadgen.arrivals import LoadSpec
from benchmarks.loadgen.bench import BenchConfig, run_benchmark
from benchmarks.loadgen.priorities import PriorityMix
from benchmarks.loadgen.report import markdown
from benchmarks.loadgen.spec import DatasetSpec
from tests.engine.helpers import random_prompts
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

LONG_TOKENS = 400


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("priority")
    config = write_config(
        tmp / "config.yaml",
        tiny_llama,
        engine={"scheduling_policy": "priority"},
        decode={"engine": {"max_num_seqs": 1}},
        router={"min_disagg_tokens": 0, "drain_grace_s": 0},
    )
    with serving(config, tmp / "home") as stack:
        yield stack


def _body(prompt: list[int], max_tokens: int, priority: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "priority": priority, "stream": stream}  # fmt: skip


async def _contended(base_url: str, long_prompt: list[int], short_prompt: list[int]):
    """Stream the long request; once it has decoded a little, send the short one. Returns
    both token lists and the order in which they finished."""
    finished: list[str] = []
    long_ids: list[int] = []
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def long_one() -> None:
            body = _body(long_prompt, LONG_TOKENS, priority=5, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        long_ids.extend(choice.get("token_ids") or [])
                    if len(long_ids) >= 10:
                        started.set()
            finished.append("long")

        async def short_one() -> list[int]:
            await started.wait()
            reply = await client.post("/v1/completions", json=_body(short_prompt, 8, priority=0))
            assert reply.status_code == 200, reply.text
            finished.append("short")
            return reply.json()["choices"][0]["token_ids"]

        _, short_ids = await asyncio.gather(long_one(), short_one())
    return long_ids, short_ids, finished


def test_a_smaller_priority_value_overtakes_a_long_decode(stack):
    long_prompt, short_prompt = random_prompts(seed=7)[:2]
    long_ids, short_ids, finished = asyncio.run(
        _contended(stack.base_url, long_prompt, short_prompt)
    )
    assert finished == ["short", "long"]
    (decode,) = worker_stats(stack, "decode")
    assert decode.num_preemptions >= 1  # the long one made room and recomputed
    # Alone, each gives the same tokens: the preemption changed nothing but the timing.
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        for prompt, max_tokens, ids in [(long_prompt, LONG_TOKENS, long_ids),
                                        (short_prompt, 8, short_ids)]:  # fmt: skip
            reply = client.post("/v1/completions", json=_body(prompt, max_tokens, priority=9))
            assert reply.json()["choices"][0]["token_ids"] == ids
    deadline = time.monotonic() + 10
    while True:  # nothing left behind on either worker
        stats = [*worker_stats(stack, "prefill"), *worker_stats(stack, "decode")]
        if all(s.num_running == s.num_waiting == s.live_leases == 0 for s in stats):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def test_bench_reports_each_priority_class(stack):
    config = BenchConfig(
        f"{stack.base_url}/v1",
        DatasetSpec("random", num_requests=12, input_len=32, output_len=24),
        (LoadSpec(rate=float("inf")),),  # all at once: the one decode slot makes a queue
        priorities=PriorityMix.parse("0:1,1:2", seed=3),
        progress=False,
    )
    report = asyncio.run(run_benchmark(config))
    (run,) = report.runs
    assert run.summary.failed == 0 and run.summary.completed == 12
    assert set(run.by_priority) == {0, 1}
    assert sum(s.completed for s in run.by_priority.values()) == 12
    assert {r.priority for r in run.results} == {0, 1}
    assert "| rate=inf | 0 | " in markdown(report) and "0:1,1:2" in markdown(report)
    # The urgent class waits less in the decode worker's one slot.
    assert run.by_priority[0].ttft_ms.median < run.by_priority[1].ttft_ms.median


def test_a_client_gone_while_queued_for_the_decode_slot_holds_nothing(stack):
    """A request queued behind the one decode slot whose client leaves after its first
    token (the prefill worker's) is gone from the decode worker's queue, and its prefill
    lease released, while the long one still decodes: the router cancels the call once
    the decode worker says its engine holds the request (which then frees the lease).
    Read on for the decode worker's first reply, it held both until the slot freed."""
    long_prompt, queued_prompt = random_prompts(seed=9)[:2]
    seen: dict[str, object] = {}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            started, released = asyncio.Event(), asyncio.Event()

            async def long_one() -> None:
                body = _body(long_prompt, LONG_TOKENS, priority=5, stream=True)
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            started.set()
                seen["long_done_at"] = time.monotonic()

            async def queued_one() -> None:
                await started.wait()
                body = _body(queued_prompt, 8, priority=9, stream=True)  # less urgent
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            break  # the first token: the client leaves
                seen["left_at"] = time.monotonic()
                while True:
                    stats = [*worker_stats(stack, "prefill"), *worker_stats(stack, "decode")]
                    if all(s.num_waiting == 0 and s.live_leases == 0 for s in stats):
                        seen["freed_at"] = time.monotonic()
                        released.set()
                        return
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(asyncio.gather(long_one(), queued_one()), 120)
            assert released.is_set()

    asyncio.run(scenario())
    assert seen["freed_at"] < seen["long_done_at"], seen
    assert seen["freed_at"] - seen["left_at"] < 5, seen


def test_a_stream_running_when_the_router_stops_ends_with_an_error_event(stack):
    """Runs last: it stops the module's stack."""
    prompt = random_prompts(seed=8)[0]
    lines: list[str] = []

    async def read() -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            body = _body(prompt, LONG_TOKENS, priority=0, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                stopping = None
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                    if len(lines) == 3:  # decoding: stop the stack (SIGTERM, as Ctrl-C)
                        stopping = asyncio.create_task(asyncio.to_thread(stack.stop))
                assert await stopping == 0

    asyncio.run(read())
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "service_unavailable" and "stopped" in error["message"], error
    assert all("choices" in json.loads(line) for line in lines[:-2])
