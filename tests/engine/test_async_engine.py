"""The engine thread behind asyncio: a step that raises fails everything open, and nothing
waits for ever on the dead thread."""

from __future__ import annotations

import asyncio

import pytest

from common.config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.async_engine import AsyncEngine, EngineFailedError

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
