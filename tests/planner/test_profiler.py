"""The profiler on a real engine: every point measured on the grid asked for, the decode
batches started together from the prefix cache, and the engine left idle and clean."""

from __future__ import annotations

import pytest

from common.engine_config import EngineConfig
from engine import LLMEngine
from planner.grid import Grid
from planner.profiler import engine_facts, profile_engine


@pytest.fixture(scope="module")
def engine(model_factory):
    config = EngineConfig(num_blocks=40, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=32, max_model_len=256, device="cpu",
                          dtype="float32")  # fmt: skip
    engine = LLMEngine(model_factory("llama"), config)
    yield engine
    engine.close()


def test_every_point_of_the_grid_that_fits_is_measured(engine):
    lines: list[str] = []
    grid = Grid(isls=(16, 100), batches=(1, 4, 8), contexts=(20, 64), warmup_steps=1,
                measured_steps=2, repeats=1)  # fmt: skip
    computed_before = engine.num_prompt_tokens_computed
    role = profile_engine(engine, grid, lines.append)

    assert role.engine == engine_facts(engine)
    assert role.engine.kv_capacity_tokens == 640
    assert [p.isl for p in role.prefill] == [16, 100]
    assert all(p.latency_s > 0 and p.tokens_per_s > 0 for p in role.prefill)
    # 9 decode steps at context 64: prompts of 60 tokens end at 70, 86 with the partial
    # block: 576 usable tokens hold 6 of them, so batch 8 is skipped there and said.
    measured = [(p.context_tokens, p.batch) for p in role.decode]
    assert measured == [(20, 8), (20, 4), (20, 1), (64, 4), (64, 1)]
    assert all(p.itl_s > 0 for p in role.decode)
    assert any("decode context 64: batches above 6 do not fit" in line for line in lines)
    assert not any("did not start together" in line for line in lines)

    # Each decode prompt is computed once, then sent again as a cache hit (its part-filled
    # last block recomputed): 8 x 16 + 4 x 60 tokens, not twice that.
    prefill_tokens = 16 + (16 + 16 * 7) + (100 + 100 * 2)  # warm-up, then each length
    decode_once = 8 * 16 + 4 * 60
    computed = engine.num_prompt_tokens_computed - computed_before
    assert prefill_tokens + decode_once <= computed <= prefill_tokens + decode_once + 12 * 16
    assert not engine.has_unfinished_requests()
    assert engine.leak_report() == []


def test_default_grid_follows_the_engine():
    from planner.profile_data import EngineFacts

    facts = EngineFacts(16, 48, 2048, 1 << 20, 4096, 1, "float32", "cpu")
    grid = Grid().for_engine(facts)
    assert grid.isls == (128, 512, 2048, 4095)
    assert grid.batches == (1, 2, 4, 8, 16, 32, 48)
    assert grid.contexts == (256, 1024, 4096 - grid._drift(7))
    assert Grid(isls=(100,)).for_engine(facts).isls == (100,)
    with pytest.raises(ValueError, match="batches must be >= 1"):
        Grid(batches=(0,))


def test_a_context_whose_requests_would_pass_the_models_context_is_measured_shorter(engine):
    """At 256 (the engine's max_model_len) a request would decode past it: the longest
    context that fits is measured instead, and said (it used to be dropped silently)."""
    lines: list[str] = []
    grid = Grid(isls=(16,), batches=(1,), contexts=(256,), warmup_steps=1, measured_steps=2,
                repeats=1)  # fmt: skip
    role = profile_engine(engine, grid, lines.append)
    (point,) = role.decode
    # One batch of 3 steps, a lead of 2 steps and the first token: 6 tokens, 1 before.
    assert point.context_tokens == 256 - (6 - 1)
    assert any(f"decode context 256: measured at {point.context_tokens}" in x for x in lines)
    assert engine.leak_report() == []
