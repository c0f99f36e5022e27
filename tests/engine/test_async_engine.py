"""The engine thread behind asyncio: a step that raises fails everything open, nothing
waits for ever on a dead or stopped thread, and a thread with nothing it can run does not
spin."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine, EngineFailedError
from worker.stats import StageTimer, stats_reply

PARAMS = SamplingParams(max_tokens=200, min_tokens=200, temperature=0)


@pytest.mark.timeout(60)
def test_a_failing_step_fails_open_streams_and_every_later_call(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=512))
    async_engine = AsyncEngine(engine)
    real_step = engine.step
    steps = [0]

    def step():
        steps[0] += 1
        if steps[0] == 5:  # a bug, or the device out of memory, mid-generation
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = step

    async def scenario() -> None:
        async_engine.start()
        outputs = []
        async for output in async_engine.generate("r1", list(range(5, 40)), PARAMS):
            outputs.append(output)
        assert outputs[-1].finished and "injected step failure" in outputs[-1].error
        assert async_engine.failure == "RuntimeError: injected step failure"
        with pytest.raises(EngineFailedError):
            async for _ in async_engine.generate("r2", list(range(5, 40)), PARAMS):
                pass
        with pytest.raises(EngineFailedError):
            await async_engine.abort("r1")

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        async_engine.stop()
    assert async_engine.num_streams == 0


@pytest.mark.timeout(60)
def test_nothing_runnable_does_not_spin_and_stop_ends_everything(tiny_llama):
    """A lease holding the whole pool leaves a new request waiting: the thread waits for
    a command instead of stepping in a tight loop (it used to step ~90,000 times a
    second). After ``stop``, the open stream ends and calls fail instead of hanging."""
    engine = LLMEngine(tiny_llama, EngineConfig(num_blocks=4, max_model_len=64))
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("held", list(range(10, 60)), params, prefill_only=True)
    while engine.has_work():
        engine.step()
    async_engine = AsyncEngine(engine)
    forward_steps = engine.num_steps
    steps = [0]
    real_step = engine.step

    def counting_step():
        steps[0] += 1
        return real_step()

    engine.step = counting_step

    async def scenario() -> None:
        async_engine.start()
        waiter = asyncio.create_task(_drain(async_engine.generate("waiter", [5] * 20, params)))
        await asyncio.sleep(1.0)
        assert engine.num_steps == forward_steps and steps[0] < 5000, steps[0]
        await asyncio.to_thread(async_engine.stop)
        last = (await asyncio.wait_for(waiter, 5))[-1]
        assert last.finished and "stopped" in last.error
        with pytest.raises(EngineFailedError):
            await asyncio.wait_for(async_engine.abort("waiter"), 5)

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        async_engine.stop()
    # The thread is gone: clean up on the engine directly, and check nothing leaked.
    engine.abort_request("waiter")
    assert engine.release_kv("held")
    assert engine.leak_report() == []


async def _drain(stream) -> list:
    return [output async for output in stream]


@pytest.mark.timeout(60)
def test_a_stream_cancelled_with_its_final_output_unread_holds_nothing(tiny_llama):
    """A prefill-only request finished (its blocks held for a decode worker) while its
    reader was being cancelled: the final output was never read, so nobody would release
    the blocks."""
    import threading
    import time

    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=256, num_blocks=64))
    may_step = threading.Event()
    step = engine.step

    def gated_step():  # the engine thread steps only once the test says so
        if engine.scheduler.requests:
            may_step.wait(30)
        return step()

    engine.step = gated_step
    async_engine = AsyncEngine(engine)

    async def scenario() -> None:
        async_engine.start()
        params = SamplingParams(max_tokens=8, temperature=0)
        stream = async_engine.generate("p1", list(range(5, 45)), params, prefill_only=True)
        task = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.2)  # admitted; the reader waits for its outputs
        assert "p1" in engine.scheduler.requests and not task.done()
        may_step.set()
        while "p1" not in engine.scheduler.held:
            time.sleep(0.001)  # this loop is busy: the final output stays unread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        await asyncio.sleep(0.2)

    try:
        asyncio.run(scenario())
        assert engine.scheduler.held == {} and engine.leak_report() == []
    finally:
        may_step.set()
        async_engine.stop()


@pytest.mark.timeout(60)
def test_a_request_left_before_the_engine_held_it_gives_up_its_kv_handle(tiny_llama):
    """Left while its grammar compiled (before the engine held it), a request that came
    with a KV handle gives it up: nothing here will pull it, and the peer may free its
    blocks at once (it held them for ``lease_s``). Held, it says so (``on_admitted``,
    the decode worker's admission header) and its abort gives the handle up."""
    import threading

    from common.structured_output import StructuredOutput
    from engine.request import RemoteKV
    from tests.engine.local_puller import LocalPuller

    puller = LocalPuller()
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=256, num_blocks=64),
                       kv_puller=puller)  # fmt: skip
    compiling, prepare = threading.Event(), engine.grammars.prepare

    def slow_prepare(*args):
        compiling.set()
        time.sleep(0.5)
        return prepare(*args)

    engine.grammars.prepare = slow_prepare
    async_engine = AsyncEngine(engine)
    prompt = list(range(5, 45))
    remote = RemoteKV("lease-1", len(prompt), (0, 1, 2), "prefill-0")
    choice = StructuredOutput("choice", '["yes", "no"]')
    held: list[bool] = []

    async def admitted() -> None:
        held.append("r2" in engine.scheduler.requests)

    async def scenario() -> None:
        async_engine.start()
        params = SamplingParams(max_tokens=8, temperature=0, structured_output=choice)
        stream = async_engine.generate("r1", prompt, params, remote_kv=remote,
                                       output_token_ids=[7])  # fmt: skip
        task = asyncio.create_task(anext(stream))
        await asyncio.to_thread(compiling.wait, 10)
        task.cancel()  # while its grammar compiles
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        assert puller.abandoned == ["lease-1"] and not engine.scheduler.requests
        # Held first (queued: the engine never steps it here), then left.
        engine.step = lambda: []
        stream = async_engine.generate("r2", prompt, PARAMS, remote_kv=remote,
                                       output_token_ids=[7], on_admitted=admitted)  # fmt: skip
        task = asyncio.create_task(anext(stream))
        while not held:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()

    try:
        asyncio.run(scenario())
        assert held == [True] and puller.abandoned == ["lease-1", "lease-1"]
        assert engine.scheduler.requests == {}
    finally:
        async_engine.stop()


@pytest.mark.timeout(60)
def test_preemptions_reach_the_stats_reply(tiny_llama):
    """Operators see preemptions (vLLM exports them too): the scheduler's count goes into
    the thread's stats snapshot and from there into the worker's Stats reply."""
    engine = LLMEngine(tiny_llama, EngineConfig(num_blocks=8, max_model_len=128))
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0)

    async def one(i: int) -> None:
        async for _ in async_engine.generate(f"r{i}", list(range(5 + i, 45 + i)), params):
            pass

    async def scenario() -> None:
        async_engine.start()
        await asyncio.gather(*(one(i) for i in range(3)))  # 3 x 80 tokens in 8 x 16 slots
        await async_engine.call(lambda e: None)  # a turn after the last step: a fresh snapshot

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        async_engine.stop()
    assert engine.scheduler.num_preemptions > 0
    assert async_engine.stats.num_preemptions == engine.scheduler.num_preemptions
    reply = stats_reply("e", "decode", async_engine.stats, StageTimer(), draining=False)
    assert reply.num_preemptions == engine.scheduler.num_preemptions
    assert engine.leak_report() == []


@pytest.mark.timeout(60)
def test_a_reader_that_fell_behind_gets_one_output_with_every_token_it_missed(tiny_llama):
    """The outputs a reader has not read yet come merged: their tokens in order, the
    last one's state (finished, log-probs up to it), nothing lost."""
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0, logprobs=1)
    prompt = list(range(5, 40))
    offline = LLMEngine(tiny_llama, EngineConfig(max_model_len=512))
    offline.add_request("r", prompt, params)
    while offline.has_unfinished_requests():
        final = offline.step()
    expected = final[0].outputs[0].token_ids
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=512))
    async_engine = AsyncEngine(engine)

    async def scenario() -> list:
        async_engine.start()
        outputs = []
        async for output in async_engine.generate("r", prompt, params):
            outputs.append(output)
            while async_engine.num_streams:  # fall behind until the request has finished
                await asyncio.sleep(0.01)
        return outputs

    try:
        outputs = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        async_engine.stop()
    assert len(outputs) == 2 and outputs[1].finished  # the first, then all the rest in one
    assert outputs[0].new_token_ids + outputs[1].new_token_ids == expected
    completion = outputs[1].outputs[0]
    assert completion.token_ids == expected and completion.finish_reason == "length"
    new = outputs[1].new_token_ids
    assert [lp.token_id for lp in completion.last_logprobs(len(new))] == new
    assert engine.leak_report() == []


@pytest.mark.timeout(60)
def test_stats_read_after_a_request_finished_show_it_gone(tiny_llama):
    """The snapshot is taken before a step's outputs are delivered: a client that saw its
    last token, then read the stats, saw its request still running with its blocks held
    (a worker fault test read them so under load). A slow hook (KV events, leases) after
    delivery widens that window to certain."""
    import time

    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=512))
    async_engine = AsyncEngine(engine)
    async_engine.hooks.append(lambda: time.sleep(0.05))
    params = SamplingParams(max_tokens=3, temperature=0)

    async def scenario() -> None:
        async_engine.start()
        for i in range(3):
            outputs = [o async for o in async_engine.generate(f"r{i}", list(range(5, 40)), params)]
            assert outputs[-1].finished
            stats = async_engine.stats
            assert stats.num_running + stats.num_waiting == 0, stats
            assert stats.kv_blocks_used == 0, stats

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        async_engine.stop()
    assert async_engine.num_streams == 0
    assert engine.scheduler.kv.pool.num_used_blocks == 0
