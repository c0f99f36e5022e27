"""Measure a running stack through its router: the same points as the engine's profile
(``planner/profiler.py``), but timed as a client sees them, so what the services add (the
router, gRPC, streaming, the workers' own threads beside their engines) is in the numbers.
Torch-free; ``pdserve plan profile --base-url URL`` runs it.

The stack should be the layout the profile is for, with one worker per role, idle:
* prefill points: prompts with ``max_tokens: 1`` finish on the prefill worker (the router
  sends no decode hop). Latency alone is the time to first token of one prompt; loaded
  speed is prompt tokens over the gaps between first tokens of prompts sent together
  (what a queue of them gets, without one prompt's fixed latency in it). Prompts shorter
  than the router's ``min_disagg_tokens`` would be prefilled on the decode worker: they are
  skipped and said.
* decode points: ``batch`` streams at once, timed over the window in which all of them
  stream. The prompts are sent once with two output tokens first, so both workers hold
  their KV and the measured streams start close together (one prompt set per context,
  reused for every batch); each stream still enters through the router, the prefill
  worker and a pull, so they run long enough to share a window, their prompts shorter
  than the context by half their length (the window's context is the context, roughly).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from datetime import UTC, datetime

import grpc
import httpx

from benchmarks.loadgen.bench import server_info
from benchmarks.loadgen.client import BenchClient, RequestResult
from benchmarks.loadgen.pinned_stack import worker_stats
from common.config import PdserveConfig, Role
from common.hosts import host_port
from planner.grid import Grid, Progress, decode_run, loaded_prompt_count
from planner.profile_data import DecodePoint, EngineFacts, PrefillPoint, Profile, RoleProfile

_VOCAB = 1000  # synthetic ids below this fit every real vocabulary (and the demo's)


def stack_facts(config: PdserveConfig, role: Role, max_model_len: int) -> EngineFacts:
    """A role's engine as the stack runs it: the config's settings, the KV pool its worker
    0 reports (its Stats)."""
    section = config.role(role) if config.role(role).replicas else config.decode
    role = role if config.role(role).replicas else Role.DECODE
    engine = config.engine_for(role)
    address = host_port(section.host, section.ports(0).grpc)
    try:
        stats = worker_stats(address, str(role))
    except grpc.RpcError as exc:
        raise RuntimeError(
            f"the {role} worker at {address} (the config's) does not answer: "
            f"{exc.code().name}; is the stack of this config running?"
        ) from None
    return EngineFacts(
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        kv_capacity_tokens=stats.kv_blocks_total * engine.block_size,
        max_model_len=max_model_len,
        tensor_parallel_size=engine.tensor_parallel_size,
        dtype=str(engine.dtype),
        device=str(engine.device),
    )


async def profile_stack(
    base_url: str,
    config: PdserveConfig,
    grid: Grid | None = None,
    progress: Progress = lambda _: None,
    api_key: str | None = None,
) -> Profile:
    try:
        info = server_info(base_url, api_key, None)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach the router at {base_url}: {exc}") from None
    max_model_len = info["max_model_len"] or config.engine.max_model_len
    if not max_model_len:
        raise ValueError(f"{base_url} does not report max_model_len; set engine.max_model_len")
    facts = {role: stack_facts(config, role, max_model_len) for role in Role}
    grid = (grid or Grid()).for_engine(facts[Role.DECODE])
    rng = random.Random(0)
    async with BenchClient(base_url, info["model"], api_key) as client:
        stack = _Stack(client, rng)
        await stack.send([[1, 2, 3]], 1)  # warm-up: first-call costs
        prefill = []
        for isl in grid.isls:
            if isl < config.router.min_disagg_tokens:
                progress(f"prefill {isl}: skipped, below router.min_disagg_tokens "
                         f"({config.router.min_disagg_tokens}): the decode worker would "
                         "prefill it")  # fmt: skip
                continue
            prefill.append(await _prefill_point(stack, facts[Role.PREFILL], grid, isl, progress))
        decode = []
        for context in grid.contexts:
            decode += await _decode_points(stack, facts[Role.DECODE], grid, context, progress)
    return Profile(
        model=info["model"],
        machine=f"the stack at {base_url}",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        prefill=RoleProfile(facts[Role.PREFILL], prefill=prefill),
        decode=RoleProfile(facts[Role.DECODE], decode=decode),
    )


class _Stack:
    def __init__(self, client: BenchClient, rng: random.Random) -> None:
        self.client = client
        self.rng = rng

    def prompt(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(5, _VOCAB) for _ in range(num_tokens)]

    async def send(self, prompts: list[list[int]], max_tokens: int) -> list[RequestResult]:
        """``prompts`` at once, streamed to their end; raises if any failed. Start and end
        times are from a common origin."""
        origin = time.perf_counter()
        results = [RequestResult(0, 0, len(p), max_tokens, 0.0) for p in prompts]
        await asyncio.gather(*(self.client.send(r, p, origin)
                               for r, p in zip(results, prompts, strict=True)))  # fmt: skip
        failed = [r.error for r in results if not r.ok or r.output_tokens != max_tokens]
        if failed:
            raise RuntimeError(f"{len(failed)} profiling requests failed: {failed[0]}")
        return results


async def _prefill_point(
    stack: _Stack, facts: EngineFacts, grid: Grid, isl: int, progress: Progress
) -> PrefillPoint:
    alone = [await stack.send([stack.prompt(isl)], 1) for _ in range(grid.repeats)]
    latency_s = statistics.median(r[0].ttft_s for r in alone)
    count = loaded_prompt_count(facts, isl, minimum=3)
    results = await stack.send([stack.prompt(isl) for _ in range(count)], 1)
    firsts = sorted(r.start_s + r.ttft_s for r in results)
    span_s = firsts[-1] - firsts[0]
    # Prompts after the first over the time after it; where they all came in one step,
    # the whole batch over its time.
    tokens_per_s = ((count - 1) * isl / span_s if span_s > latency_s / 4
                    else count * isl / firsts[-1])  # fmt: skip
    progress(f"prefill {isl:>6} tokens: alone {latency_s * 1000:8.1f} ms, "
             f"{tokens_per_s:10.0f} tokens/s loaded ({count} prompts)")  # fmt: skip
    return PrefillPoint(isl, latency_s, tokens_per_s)


_TRIES = 3  # runs of one decode batch before it is skipped


async def _decode_points(
    stack: _Stack, facts: EngineFacts, grid: Grid, context: int, progress: Progress
) -> list[DecodePoint]:
    batches = sorted(grid.batches, reverse=True)
    # Streams enter over many steps (each through the prefill worker, its KV pulled):
    # each runs this much longer than the window all share, half before it.
    lead = 2 * min(batches[0], facts.max_num_seqs) + 8
    max_tokens = lead + grid.steps_per_batch
    run = decode_run(facts, batches, context, max_tokens // 2, max_tokens, progress)
    if run is None:
        return []
    context, prompt_len, fitting = run.context, run.prompt_len, run.batches
    prompts = [stack.prompt(prompt_len) for _ in range(fitting[0])]
    await stack.send(prompts, 2)  # the decode worker holds their KV now
    points = []
    for batch in fitting:
        itl_s = None
        for _ in range(_TRIES):  # a busy host can stagger the streams' starts past the lead
            results = await stack.send(prompts[:batch], max_tokens)
            itl_s = _window_itl(results, grid.measured_steps)
            if itl_s is not None:
                break
        if itl_s is None:
            progress(f"decode context {context}, batch {batch}: the streams did not overlap "
                     f"for {grid.measured_steps} tokens in {_TRIES} tries; skipped")  # fmt: skip
            continue
        progress(f"decode context {context:>6}, batch {batch:>4}: {itl_s * 1000:8.2f} ms a token")
        points.append(DecodePoint(batch, context, itl_s))
    return points


def _window_itl(results: list[RequestResult], min_tokens: int) -> float | None:
    """The mean time between tokens while every stream was streaming: from the last
    stream's first token to the first stream's last, each stream's tokens in that window
    over its length. None if the window holds fewer than ``min_tokens`` of a stream's."""
    arrivals = [[r.start_s + t for t, n in zip(r.chunk_times_s, r.chunk_tokens, strict=True)
                 for _ in range(n)] for r in results]  # fmt: skip
    start = max(a[0] for a in arrivals)
    end = min(a[-1] for a in arrivals)
    gaps = []
    for times in arrivals:
        inside = [t for t in times if start <= t <= end]
        if len(inside) - 1 < min_tokens:
            return None
        gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.mean(gaps)
