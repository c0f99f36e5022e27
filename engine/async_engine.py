"""Runs an ``LLMEngine`` on its own thread and serves it to asyncio code.

The engine is single-threaded by contract: every call into it (admit, abort, release,
step, connector polling) happens on the engine thread. asyncio callers send commands
through a queue and get results back on their loop:

    gRPC handler ──submit(cmd)──► queue ──► engine thread: run cmds, step(), hooks
         ▲                                        │
         └──── asyncio.Queue per request ◄────────┘ (call_soon_threadsafe)

``hooks`` run on the engine thread after every loop turn (publishing KV events, expiring
leases, polling connector notifications); they must be quick and must not raise.

If a step raises (a bug, or the device out of memory), the engine's state can no longer be
trusted: the thread fails every open request and every pending or later call with
``EngineFailedError`` and stops, and ``failure`` says why (the worker then reports itself
unhealthy). Nothing waits for ever on a dead thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # how long the idle loop sleeps waiting for a command
_PULL_WAIT_S = 0.0005  # how long it waits when a step could run nothing (pulls, no room)


class EngineFailedError(RuntimeError):
    """The engine thread stopped after a step raised; the message says what it raised."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine, taken on its thread after each step (before its outputs
    are delivered) and after each loop turn."""

    num_running: int = 0
    num_waiting: int = 0
    num_fetching: int = 0
    num_held: int = 0
    num_preemptions: int = 0  # cumulative: requests put back to recompute
    queued_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    # Of the used: held for failed pulls whose transfer may still write them (late ones),
    # until it has ended (``engine.kv_connector``).
    kv_blocks_quarantined: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # exponentially averaged over busy steps
    num_pull_failures: int = 0
    num_blocks_reused_for_remote: int = 0
    num_steps: int = 0
    busy_s: float = 0.0  # cumulative: ``LLMEngine.busy_s``
    cpu_blocks_total: int = 0
    cpu_blocks_used: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    cpu_hit_blocks: int = 0
    cpu_load_seconds: float = 0.0
    draft_tokens: int = 0  # cumulative: speculative drafts verified
    accepted_draft_tokens: int = 0  # of those, kept
    # Expert parallelism's rebalancing (``model_runner.ExpertBalance``).
    expert_rebalances: int = 0
    expert_moved_slots: int = 0
    expert_imbalance: float = 0.0  # the last window's; 0.0 until the first rebalance
    images_encoded: int = 0  # cumulative: a vision-language model's images encoded


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.hooks: list[Callable[[], None]] = []
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable]] = (
            queue.SimpleQueue()
        )
        self.failure: str | None = None  # set, once, when a step raised (see the docstring)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._busy_since: float | None = None  # when the running step or command began
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._prefill_rate = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; streams still open end with an error, and every call
        from now on raises ``EngineFailedError`` instead of waiting forever."""
        self._stop.set()
        self._commands.put((concurrent.futures.Future(), lambda engine: None))  # a wake-up
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive() and self.failure is None:
            self._fail("the engine was stopped")

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def busy_for_s(self) -> float:
        """How long the engine thread has been in its current step or command (0 when
        waiting): a watchdog's measure of a hung device. Safe from any thread."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def fail_stuck(self, reason: str) -> None:
        """From outside the engine thread, once it is stuck (a hung device): fail every
        open stream and command now; the thread stops if it ever comes back."""
        self._stop.set()
        self._fail(reason)

    # ------------------------------------------------------------------ asyncio side

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise;
        ``EngineFailedError`` once the engine thread has failed)."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((future, fn))
        if self.failure is not None:  # failed meanwhile: nobody would run it
            self._fail_pending_commands()
        return await asyncio.wrap_future(future)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_admitted: Callable[[], Awaitable[None]] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request and yield its outputs until it finishes. Outputs that arrived
        since the last read come as one (``_merged``: ``new_token_ids`` holds all their
        tokens), so a slow reader never falls further behind. Leaving the iterator early
        (the caller was cancelled or disconnected) aborts the request; one left before
        the engine held it gives up its ``remote_kv`` (the peer may free it at once).
        ``on_admitted``: awaited once the engine holds the request."""
        loop = asyncio.get_running_loop()

        async def prepare() -> None:
            if params.structured_output is not None and kwargs.get("grammar") is None:
                # Compiling a large schema takes a while: not on the engine thread, which
                # would stall every sequence in the batch meanwhile.
                kwargs["grammar"] = await asyncio.to_thread(
                    self.engine.grammars.prepare,
                    params.structured_output,
                    kwargs.get("output_token_ids", ()),
                )
            if kwargs.get("images"):  # decoding large images takes milliseconds: likewise
                decode = kwargs.get("remote_kv") is None  # a pulled prompt's: when needed
                kwargs["images"] = await asyncio.to_thread(
                    self.engine.prepare_images, prompt_token_ids, kwargs["images"], decode
                )

        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        admitted = [False]  # written on the engine thread

        def admit(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt_token_ids, params, **kwargs)
            self._streams[request_id] = (loop, outputs)
            admitted[0] = True

        def abort_if_admitted(engine: LLMEngine) -> None:
            # Runs after ``admit`` (commands run in order): it was admitted, or skipped.
            if admitted[0]:
                self._abort(engine, request_id)
                # A prefill-only request may have finished with its final output unread:
                # its held blocks are then nobody's (a held request of this id is ours).
                engine.release_kv(request_id)
            elif kwargs.get("remote_kv") is not None:
                # Left while its grammar or images were prepared (or refused): nothing
                # here will read the peer's blocks. Left to the lease, a queue of such
                # requests held the prefill worker's blocks for ``lease_s``.
                engine.abandon_remote_kv(kwargs["remote_kv"])

        finished = False
        try:
            await prepare()
            await self.call(admit)
            if on_admitted is not None:
                await on_admitted()
            while not finished:
                unread = [await outputs.get()]
                while not unread[-1].finished and not outputs.empty():
                    unread.append(outputs.get_nowait())
                output = _merged(unread) if len(unread) > 1 else unread[0]
                finished = output.finished
                yield output
        finally:
            if not finished:  # cancelled (before admit too), or refused: abort it
                with contextlib.suppress(EngineFailedError):
                    await asyncio.shield(self.call(abort_if_admitted))

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda engine: self._abort(engine, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        output = engine.abort_request(request_id)
        if output is not None:
            self._snapshot()  # as after a step: the stats first
            self._deliver([output])
        return output is not None

    # ------------------------------------------------------------------ engine thread

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one ``call_soon_threadsafe`` per event
        loop, not one per output. Each call writes to the loop's wake-up socket; at batch
        256 that was ~270 us of the engine thread a step, now ~16 (measured here)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            loop, queue_ = stream
            by_loop.setdefault(loop, []).append((queue_, output))
        for loop, items in by_loop.items():
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    def _run(self) -> None:
        engine = self.engine
        wait_s = 0.0  # how long to wait for a command before stepping again
        while not self._stop.is_set():
            self._run_commands(wait_s if engine.has_work() else _IDLE_WAIT_S)
            wait_s = 0.0
            if engine.has_work():
                num_steps = engine.num_steps
                self._busy_since = time.monotonic()
                try:
                    outputs = engine.step()
                except Exception as exc:
                    logger.exception("engine step failed: failing every request and stopping")
                    self._fail(f"{type(exc).__name__}: {exc}")
                    return
                finally:
                    self._busy_since = None
                if self._stop.is_set():  # failed from outside meanwhile (fail_stuck)
                    return
                self._update_rate()
                # Stats first: a client that saw its request finish then reads stats
                # in which it has finished (its blocks freed), not the turn before's.
                self._snapshot()
                self._deliver(outputs)
                if engine.num_steps == num_steps and not outputs:
                    # Nothing could run (only pulls in flight, or no room until a lease
                    # is released): do not spin; a command (release, abort) wakes it.
                    # Only quarantined blocks (a frozen peer's, maybe for good): poll for
                    # their release as rarely as when idle.
                    wait_s = _PULL_WAIT_S if engine.has_pulls_or_requests() else _IDLE_WAIT_S
            for hook in self.hooks:
                try:
                    hook()
                except Exception:
                    logger.exception("engine hook failed")
            self._snapshot()

    def _run_commands(self, wait_s: float) -> None:
        """Run the queued commands, waiting up to ``wait_s`` for the first."""
        try:
            if wait_s > 0:
                command = self._commands.get(timeout=wait_s)
            else:
                command = self._commands.get_nowait()
            while True:
                future, fn = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except BaseException as exc:
                        future.set_exception(exc)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _fail(self, reason: str) -> None:
        """The engine cannot go on: end every open stream with an error and refuse every
        command, pending or later."""
        self.failure = reason
        for request_id, (loop, outputs) in list(self._streams.items()):
            failed = RequestOutput(request_id, [], [], finished=True, error=reason,
                                   engine_failed=True)  # fmt: skip
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens
                loop.call_soon_threadsafe(outputs.put_nowait, failed)
        self._streams.clear()
        self._fail_pending_commands()

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                future, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineFailedError(self.failure))

    def _update_rate(self) -> None:
        step = self.engine.last_step
        if step is None or step.num_prompt_tokens < 16 or step.duration_s <= 0:
            return
        rate = step.num_prompt_tokens / step.duration_s
        self._prefill_rate = (
            rate if not self._prefill_rate else 0.8 * self._prefill_rate + 0.2 * rate
        )

    def _snapshot(self) -> None:
        scheduler = self.engine.scheduler
        kv = scheduler.kv
        tier = self.engine.cpu_tier
        balance = self.engine.runner.expert_balance
        tier_stats = {}
        if tier is not None:
            tier_stats = dict(
                cpu_blocks_total=tier.num_blocks,
                cpu_blocks_used=tier.num_used_blocks,
                offloaded_blocks=tier.stats.offloaded_blocks,
                offloaded_bytes=tier.stats.offloaded_bytes,
                cpu_hit_blocks=tier.stats.hit_blocks,
                cpu_load_seconds=tier.stats.load_seconds,
            )
        self.stats = EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_fetching=len(scheduler.fetching),
            num_held=len(scheduler.held),
            num_preemptions=scheduler.num_preemptions,
            queued_prefill_tokens=scheduler.num_queued_prefill_tokens,
            # (a hybrid model's held snapshots count as free: a step short of blocks
            # takes them before anything else)
            kv_blocks_used=kv.pool.num_used_blocks - kv.num_held_snapshot_blocks,
            kv_blocks_free=kv.pool.num_free_blocks + kv.num_held_snapshot_blocks,
            kv_blocks_total=kv.pool.num_blocks,
            kv_blocks_quarantined=kv.num_quarantined_blocks,
            prefix_query_tokens=kv.num_query_tokens,
            prefix_hit_tokens=kv.num_hit_tokens,
            prefill_tokens_per_s=self._prefill_rate,
            num_pull_failures=self.engine.num_pull_failures,
            num_blocks_reused_for_remote=scheduler.num_blocks_reused_for_remote,
            num_steps=self.engine.num_steps,
            busy_s=self.engine.busy_s,
            draft_tokens=scheduler.num_draft_tokens,
            accepted_draft_tokens=scheduler.num_accepted_tokens,
            expert_rebalances=balance.num_rebalances,
            expert_moved_slots=balance.num_moved_slots,
            expert_imbalance=balance.imbalance if balance.num_rebalances else 0.0,
            images_encoded=self.engine.runner.num_images_encoded,
            **tier_stats,
        )


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, output in items:
        outputs.put_nowait(output)


def _merged(unread: list[RequestOutput]) -> RequestOutput:
    """One output for those a reader had not read yet: the last one (every field but
    ``new_token_ids`` says where the request stands, and the last is newest) with the
    tokens all added, in one pass (merged two at a time, k outputs copied k^2 / 2
    tokens). A reader that falls behind (a gRPC stream writing slower than the engine
    steps) so sends one message for what it missed instead of one per step: what it has
    to do shrinks just when it has too much to do, and no token waits for it."""
    tokens = [token for output in unread for token in output.new_token_ids]
    return replace(unread[-1], new_token_ids=tokens)
