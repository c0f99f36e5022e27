"""One run: a workload offered to the server under one load, every request timed.

Sessions start at their open-loop start times (or whenever a closed-loop slot frees up);
within a session, turns go one after another, each prompt carrying the history. The run
stops issuing requests once ``duration_s`` has passed, and then waits for those in flight
(each bounded by the client's timeout). A session whose request failed sends no more turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from tqdm import tqdm

from benchmarks.loadgen.arrivals import LoadSpec, session_starts
from benchmarks.loadgen.client import BenchClient, RequestResult
from benchmarks.loadgen.priorities import PriorityMix
from benchmarks.loadgen.tokens import TokenSource
from benchmarks.loadgen.workload import Session, Workload

# Filler replies (when the server sends no token ids) come from streams far from datasets'.
_FILLER_STREAM = 1 << 20


class _Run:
    def __init__(
        self,
        client: BenchClient,
        workload: Workload,
        load: LoadSpec,
        tokens: TokenSource,
        progress: bool,
        priorities: PriorityMix | None,
    ) -> None:
        self.client = client
        self.priorities = priorities
        self.load = load
        self.tokens = tokens
        self.results: list[RequestResult] = []
        self.bar = tqdm(
            total=workload.num_requests,
            desc=load.label,
            unit="req",
            disable=not progress,
            dynamic_ncols=True,
        )
        self.failed = 0
        self.limit = (
            asyncio.Semaphore(load.max_concurrency)
            if load.max_concurrency
            else contextlib.nullcontext()
        )
        self.start = time.perf_counter()

    def expired(self) -> bool:
        duration = self.load.duration_s
        return duration is not None and time.perf_counter() - self.start >= duration

    def _reply(self, session: Session, turn: int, result: RequestResult) -> list[int]:
        if len(result.output_token_ids) == result.output_tokens:
            return result.output_token_ids
        rng = self.tokens.stream(_FILLER_STREAM + session.session_id * 1024 + turn)
        return list(self.tokens.draw(rng, result.output_tokens))

    async def session(self, session: Session) -> None:
        history: list[int] = []
        priority = None
        if self.priorities is not None:
            priority = self.priorities.of(session.session_id)
        for k, turn in enumerate(session.turns):
            if k and session.think_time_s:
                await asyncio.sleep(session.think_time_s)
            if k and self.expired():
                return
            prompt = history + list(turn.new_tokens)
            result = RequestResult(session.session_id, k, len(prompt), turn.output_tokens, 0.0)
            result.priority = priority
            async with self.limit:
                await self.client.send(result, prompt, self.start)
            self.results.append(result)
            self.failed += not result.ok
            self.bar.update(1)
            if self.failed:
                self.bar.set_postfix(failed=self.failed, refresh=False)
            if not result.ok:
                return
            history = prompt + self._reply(session, k, result)

    async def open_loop(self, workload: Workload, seed: int) -> None:
        sessions = workload.sessions
        arrivals = None
        if self.load.replay and workload.has_trace_times:
            arrivals = [s.arrival_s for s in sessions if s.arrival_s is not None]
        starts = session_starts(self.load, len(sessions), arrivals, seed)
        tasks = []
        for at, session in sorted(zip(starts, sessions, strict=True), key=lambda p: p[0]):
            if self.load.duration_s is not None and at >= self.load.duration_s:
                break
            delay = self.start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.session(session)))
        await asyncio.gather(*tasks)

    async def closed_loop(self, sessions: tuple[Session, ...]) -> None:
        pending = iter(sessions)  # shared by the slots; the event loop is single-threaded

        async def slot() -> None:
            for session in pending:
                if self.expired():
                    return
                await self.session(session)

        assert self.load.concurrency is not None
        await asyncio.gather(*(slot() for _ in range(self.load.concurrency)))


async def run_load(
    client: BenchClient,
    workload: Workload,
    load: LoadSpec,
    tokens: TokenSource,
    seed: int = 0,
    progress: bool = True,
    priorities: PriorityMix | None = None,
) -> list[RequestResult]:
    """Offer ``workload`` under ``load``; the results of every request sent, in order of
    completion, with ``start_s``/``end_s`` measured from the run's start. ``priorities``:
    each session's class; None: no priority sent."""
    run = _Run(client, workload, load, tokens, progress, priorities)
    try:
        if load.closed_loop:
            await run.closed_loop(workload.sessions)
        else:
            await run.open_loop(workload, seed)
    finally:
        run.bar.close()
    return run.results
