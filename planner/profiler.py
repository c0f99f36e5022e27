"""Measure a deployment's engine: prefill speed by prompt length, decode step time by batch
and context. ``pdserve plan profile`` runs it; the sizing reads what it writes.

It runs each role's engine in this process, as a worker would (the role's engine config,
its device, its tensor-parallel ranks), without the services around it: what a worker adds
on top (gRPC, the asyncio loop) is small beside a step on a real model, and the prediction
is checked against a whole stack in ``benchmarks/planner.py``.

Prompts are random token ids, distinct per request, so nothing is prefix-cached.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.records import machine
from common.config import PdserveConfig, Role
from common.engine_config import EngineConfig
from common.model_info import model_dir_of
from engine import LLMEngine, SamplingParams
from planner.grid import Grid, Progress, decode_run, loaded_prompt_count
from planner.profile_data import (
    DecodePoint,
    EngineFacts,
    PrefillPoint,
    Profile,
    RoleProfile,
)


def engine_facts(engine: LLMEngine) -> EngineFacts:
    config = engine.config
    return EngineFacts(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_capacity_tokens=engine.runner.num_blocks * config.block_size,
        max_model_len=engine.max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=engine.device.type,
    )


def profile_deployment(
    config: PdserveConfig, grid: Grid | None = None, progress: Progress = lambda _: None
) -> Profile:
    """Both roles of ``config``'s deployment. One engine serves both measurements where the
    roles' engine configs are the same; otherwise one engine per role, one after the
    other (never two on the device at once)."""
    grid = grid or Grid()
    model_dir = model_dir_of(config)
    if config.model is None:
        from engine.models.maker import ensure_model

        model_dir = ensure_model()
    configs = {role: config.engine_for(role) for role in Role}
    if configs[Role.PREFILL] == configs[Role.DECODE]:
        both = _profile_role(model_dir, configs[Role.PREFILL], grid, progress, "both roles")
        roles = {Role.PREFILL: both, Role.DECODE: both}
    else:
        roles = {
            role: _profile_role(model_dir, configs[role], grid, progress, f"{role} role")
            for role in Role
        }
    return Profile(
        model=str(model_dir),
        machine=machine(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        prefill=RoleProfile(roles[Role.PREFILL].engine, prefill=roles[Role.PREFILL].prefill),
        decode=RoleProfile(roles[Role.DECODE].engine, decode=roles[Role.DECODE].decode),
    )


def _profile_role(
    model_dir: Path, engine_config: EngineConfig, grid: Grid, progress: Progress, what: str
) -> RoleProfile:
    progress(f"loading {model_dir} for {what}")
    engine = LLMEngine(model_dir, engine_config)
    try:
        return profile_engine(engine, grid, progress)
    finally:
        engine.close()


def profile_engine(engine: LLMEngine, grid: Grid, progress: Progress) -> RoleProfile:
    """Prefill and decode points of an idle ``engine``, which is idle again after."""
    facts = engine_facts(engine)
    grid = grid.for_engine(facts)
    prompts = _Prompts(engine.arch.vocab_size)
    _run(engine, prompts, [prompts.make(min(grid.isls))])  # warm-up: first-call costs
    prefill = [_prefill_point(engine, facts, grid, isl, prompts, progress) for isl in grid.isls]
    decode = [
        point
        for context in grid.contexts
        for point in _decode_points(engine, facts, grid, context, prompts, progress)
    ]
    problems = engine.leak_report()
    assert not problems, f"profiling leaked: {problems}"
    return RoleProfile(facts, prefill, decode)


class _Prompts:
    """Random prompts and request ids, distinct each time (so no prefix is cached)."""

    def __init__(self, vocab_size: int) -> None:
        self._rng = random.Random(0)
        self._vocab_size = vocab_size
        self._count = 0

    def make(self, num_tokens: int) -> list[int]:
        return [self._rng.randrange(5, self._vocab_size) for _ in range(num_tokens)]

    def request_id(self) -> str:
        self._count += 1
        return f"profile-{self._count}"


def _run(
    engine: LLMEngine, prompts: _Prompts, token_ids: list[list[int]]
) -> list[tuple[float, int]]:
    """``token_ids`` (prompts) at once, stepped until each has its one token: each step's
    wall time and prompt tokens computed."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for prompt in token_ids:
        engine.add_request(prompts.request_id(), prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        _sync(engine)
        assert engine.last_step is not None
        steps.append((time.perf_counter() - start, engine.last_step.num_prompt_tokens))
    return steps


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _prefill_point(
    engine: LLMEngine,
    facts: EngineFacts,
    grid: Grid,
    isl: int,
    prompts: _Prompts,
    progress: Progress,
) -> PrefillPoint:
    """A lone prompt's latency (median of ``grid.repeats``), then enough prompts at once to
    fill at least three steps: their tokens over the steps' time, the last step left out
    (a part-filled tail that a loaded worker never has)."""
    latency_s = statistics.median(
        sum(s for s, _ in _run(engine, prompts, [prompts.make(isl)])) for _ in range(grid.repeats)
    )
    count = loaded_prompt_count(facts, isl, minimum=2)
    steps = _run(engine, prompts, [prompts.make(isl) for _ in range(count)])
    steps = steps[:-1] if len(steps) > 1 else steps
    tokens_per_s = sum(n for _, n in steps) / sum(s for s, _ in steps)
    progress(f"prefill {isl:>6} tokens: alone {latency_s * 1000:8.1f} ms, "
             f"{tokens_per_s:10.0f} tokens/s loaded ({count} prompts)")  # fmt: skip
    return PrefillPoint(isl, latency_s, tokens_per_s)


def _decode_points(
    engine: LLMEngine,
    facts: EngineFacts,
    grid: Grid,
    context: int,
    prompts: _Prompts,
    progress: Progress,
) -> list[DecodePoint]:
    """Every batch of ``grid`` at ``context``: the largest batch's requests start together,
    then are measured largest batch first, requests aborted between batches. Their
    prompts are shorter than ``context`` by half the steps all batches take, so the mean
    context over the measurements is ``context``. To start together, the prompts are
    computed once first and then sent again as prefix-cache hits (all but a part-filled
    last block cached), so they all enter within a step or two instead of the first
    decoding while the last are still prefilled. A batch the KV pool cannot hold at this
    context is skipped (and said)."""
    batches = sorted(grid.batches, reverse=True)
    total_steps = len(batches) * grid.steps_per_batch
    cached = engine.config.enable_prefix_caching
    # How many steps the first request to decode may lead the last one by.
    entry_tokens = min(batches[0], facts.max_num_seqs) * (facts.block_size if cached else context)
    lead_steps = math.ceil(entry_tokens / facts.max_num_batched_tokens) + 1
    max_tokens = lead_steps + total_steps + 1
    run = decode_run(facts, batches, context, total_steps // 2, max_tokens, progress)
    if run is None:
        return []
    context, prompt_len, fitting = run.context, run.prompt_len, run.batches
    token_ids = [prompts.make(prompt_len) for _ in range(fitting[0])]
    if cached:
        _run(engine, prompts, token_ids)  # cached now: the requests below start together
    else:
        progress(f"decode context {context}: prefix caching is off, so the requests enter one "
                 f"after another, their contexts up to {lead_steps} tokens apart")  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request_ids = [prompts.request_id() for _ in token_ids]
    for request_id, prompt in zip(request_ids, token_ids, strict=True):
        engine.add_request(request_id, prompt, params)
    requests = [engine.scheduler.requests[r] for r in request_ids]
    while any(not request.output_token_ids for request in requests):
        engine.step()  # until every prompt is in (its first token made)
    spread = max(r.num_tokens for r in requests) - min(r.num_tokens for r in requests)
    if spread > lead_steps:
        progress(f"decode context {context}: the requests' contexts differ by {spread} tokens "
                 "(they did not start together)")  # fmt: skip
    points = []
    for batch in fitting:
        for request_id in request_ids[batch:]:
            engine.abort_request(request_id)
        request_ids = request_ids[:batch]
        for _ in range(grid.warmup_steps):
            engine.step()
        step_s = []
        for _ in range(grid.measured_steps):
            start = time.perf_counter()
            engine.step()
            _sync(engine)
            step_s.append(time.perf_counter() - start)
            assert engine.last_step is not None and engine.last_step.num_tokens >= batch, (
                f"a decode step of batch {batch} computed {engine.last_step}"
            )
        itl_s = statistics.median(step_s)
        progress(f"decode context {context:>6}, batch {batch:>4}: {itl_s * 1000:8.2f} ms a step")
        points.append(DecodePoint(batch, context, itl_s))
    for request_id in request_ids:
        engine.abort_request(request_id)
    return points
