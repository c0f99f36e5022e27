"""The router's view of the workers: who exists (registry), who is healthy (gRPC health),
how loaded each is (Stats plus the router's own in-flight accounting), and their stubs.

A worker that is draining, fails its health check, or leaves the registry stops being a
candidate at once; requests already on it finish, unless it stops answering altogether for
``stall_timeout_s``: then they are failed (see ``WorkerPool._give_up_if_stalled``). New
registry entries are picked up on the next refresh, so workers can be added and removed
while the router runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import Role
from common.hashing import lora_key
from common.internal_auth import NO_AUTH, TOKEN_ENV, InternalAuth
from common.outage_log import OutageLog
from common.registry import Registry, WorkerInfo
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.decode_gate import Ahead, DecodeGate
from router.events import EventListener
from router.once import once
from router.policy import WorkerLoad

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0  # a health check (and the Stats call after it) gets this long

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 << 20),
    # A worker not listening yet (starting beside the router, or restarting) is retried
    # at most 1 s apart, in step with the probes: gRPC's default backoff grows to 120 s,
    # and a probe made while the channel waits it out fails without trying to connect,
    # so a worker back after a few seconds could go unseen for many more.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
# A decode stream the router is not reading takes at most this many bytes ahead (gRPC's
# default lets it take 64 KiB, ~5,000 one-token messages, and bandwidth probing grows
# that). So when the router falls behind its decode workers, their writes wait, and the
# outputs the engine makes meanwhile leave as one message (``AsyncEngine``'s merge): the
# router then handles a message, a detokenizer call and an SSE chunk per several tokens
# instead of per token, and a stream lags by a few messages, not thousands. A stream the
# router is reading is unaffected: a pending read lets the message in flight through
# whole, however large (gRPC's minimum progress), and below saturation every message is
# still one step's tokens (``benchmarks/router_stream.py``).
DECODE_STREAM_WINDOW_BYTES = 256
DECODE_CHANNEL_OPTIONS = [
    *_CHANNEL_OPTIONS,
    ("grpc.http2.lookahead_bytes", DECODE_STREAM_WINDOW_BYTES),
    ("grpc.http2.bdp_probe", 0),  # it would grow the window back
]


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter as workers report it (Stats): its name and its files' fingerprint.
    Workers with equal ones compute equal KV for a prompt."""

    name: str
    fingerprint: str

    @property
    def key(self) -> str:
        """What its blocks are salted with (``common.hashing.lora_key``), as on workers."""
        return lora_key(self.name, self.fingerprint)


@dataclass
class WorkerState:
    info: WorkerInfo
    channel: grpc.aio.Channel
    prefill: pb_grpc.PrefillServiceStub | None
    decode: pb_grpc.DecodeServiceStub | None
    health: health_pb2_grpc.HealthStub
    healthy: bool = False
    refuses_us: bool = False  # its probes answer UNAUTHENTICATED (logged once)
    stats: pb.StatsResponse = field(default_factory=pb.StatsResponse)
    # The router's own accounting, exact between Stats polls.
    queued_prefill_tokens: int = 0
    num_running: int = 0
    kv_blocks_in_use: int = 0
    # Sequences placed on this decode worker that have not reached it yet (in prefill or
    # before their Generate call), and the blocks their prompts will take there: a burst
    # of long prompts is still prefilling when the next placement looks.
    assigned: int = 0
    assigned_blocks: int = 0
    # Backpressure: the sequences held back until this worker has room, and those let
    # through that have not ended.
    gate: DecodeGate = field(default_factory=DecodeGate)
    ahead: Ahead = field(default_factory=Ahead)
    # Stall detection: when it last answered a probe (time.monotonic()), how many probes
    # in a row it has missed since, its calls in flight, and those of them the pool
    # cancelled because it stopped answering.
    answered_at: float = field(default_factory=time.monotonic)
    missed_probes: int = 0
    ever_answered: bool = False  # else unreachable since it joined: said once (_probe)
    said_unreachable: bool = False
    calls: set[grpc.aio.Call] = field(default_factory=set)
    abandoned: set[grpc.aio.Call] = field(default_factory=set)
    departed_channel: grpc.aio.Channel | None = None  # probes it once out of the registry
    missing_since: float | None = None  # time.monotonic() it was first missing from it
    # Its LoRA adapters, name -> fingerprint: from each Stats, and from this router's
    # loads and unloads as they succeed (``lora_version`` counts those, so a Stats
    # reply that was on its way meanwhile does not undo one).
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_version: int = 0

    @contextlib.contextmanager
    def tracking(self, call: grpc.aio.Call) -> Iterator[None]:
        """Wrap the use of ``call``: if the pool gives up on this worker meanwhile, the
        call's cancellation surfaces as ``WorkerStalled`` instead of ``CancelledError``."""
        self.calls.add(call)
        try:
            yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call in self.abandoned and (task is None or not task.cancelling()):
                raise WorkerStalled(self.worker_id) from None
            raise
        finally:
            self.calls.discard(call)
            self.abandoned.discard(call)

    def answered(self) -> None:
        self.answered_at = time.monotonic()
        self.missed_probes = 0
        self.refuses_us = False
        self.ever_answered = True

    def assign(self, num_blocks: int) -> Callable[[], None]:
        """Count one sequence placed here until the returned call ends that (once,
        however often it is called): when its Generate call is issued, or it ends first."""
        self.assigned += 1
        self.assigned_blocks += num_blocks

        def arrived() -> None:
            self.assigned -= 1
            self.assigned_blocks -= num_blocks

        return once(arrived)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def available(self) -> bool:
        return self.healthy and not self.info.draining and not self.stats.draining

    @property
    def stub(self) -> pb_grpc.PrefillServiceStub | pb_grpc.DecodeServiceStub:
        """Its role's service, for the RPCs both roles answer (Stats, LoRA loads)."""
        stub = self.prefill or self.decode
        assert stub is not None
        return stub

    def serves(self, lora: LoraRef | None) -> bool:
        """Whether requests of ``lora`` (None: the base model) may run here."""
        return lora is None or self.lora_adapters.get(lora.name) == lora.fingerprint

    def set_lora_adapters(self, adapters: dict[str, str]) -> None:
        """What a load or unload through this router left on the worker."""
        self.lora_adapters = adapters
        self.lora_version += 1

    def load(self) -> WorkerLoad:
        """Its load for placement: this router's own count (exact, and ahead of the
        worker's for what is on its way), or the worker's last Stats where that is more
        (other routers' work: routers that counted only their own sent a shared prefix's
        every request to its holder while another worker idled), plus what this router
        placed that has not reached it."""
        stats = self.stats
        num_running = max(self.num_running, stats.num_running + stats.num_waiting)
        return WorkerLoad(
            worker_id=self.worker_id,
            queued_prefill_tokens=max(self.queued_prefill_tokens, stats.queued_prefill_tokens),
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            num_running=num_running + self.assigned,
            kv_blocks_in_use=max(self.kv_blocks_in_use, stats.kv_blocks_used)
            + self.assigned_blocks,
            kv_blocks_total=self.kv_blocks_total,
            kv_blocks_free=self.stats.kv_blocks_free if self.stats.kv_blocks_total else None,
        )

    @property
    def kv_blocks_total(self) -> int:
        """Its KV cache in blocks; 0 if not known yet."""
        return self.stats.kv_blocks_total or self.info.kv_blocks_total


class WorkerStalled(Exception):
    """The pool cancelled a call because its worker stopped answering probes."""


class WorkerPool:
    def __init__(
        self,
        registry: Registry,
        events: EventListener,
        refresh_s: float,
        request_timeout_s: float,
        stall_timeout_s: float = 10.0,
        missing_grace_s: float = 0.0,
        auth: InternalAuth = NO_AUTH,
        block_size: int = 0,
        model: str = "",
        connector: str = "",
    ) -> None:
        self.registry = registry
        self.auth = auth  # every channel to a worker carries its token
        # What a worker must share with the router to join ("" or 0: anything). Its
        # block size: with another it hashes its prefixes at other boundaries, so no
        # prefix of the router's would ever match its cache, and a pull between it and a
        # worker of the router's size fails at the handshake. Its model (the config's
        # ``model``): two deployments under one Redis and the default key prefix shared
        # their workers, and a request's tokens depended on where it was placed. Its
        # connector: a decode worker of another cannot pull from the prefill workers.
        self.block_size = block_size
        self.model = model
        self.connector = connector
        self._mismatched: set[tuple[str, str]] = set()  # (worker id, engine id) logged
        self.events = events
        self.refresh_s = refresh_s
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        # A worker gone from the registry that still answers its probes stays this long:
        # a registry that lost its keys (FLUSHDB, a restart without persistence, an outage
        # past the entries' TTL) gets them back at the workers' next heartbeats, and
        # dropping every worker meanwhile turned away all requests.
        self.missing_grace_s = missing_grace_s
        self.workers: dict[str, WorkerState] = {}
        # Gone from the registry with calls still on them: probed only to fail those calls
        # if the worker is frozen (a frozen worker's registry entry expires too).
        self._departed: dict[str, WorkerState] = {}
        self._task: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()  # channels closing with a grace period
        self._registry_outage = OutageLog(logger, "registry unreachable, keeping the last "
                                          "worker list")  # fmt: skip

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for state in self.workers.values():
            await state.channel.close()
        for state in self._departed.values():
            if state.departed_channel is not None:
                await state.departed_channel.close()
        for task in list(self._retiring):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def candidates(self, role: Role, lora: LoraRef | None = None) -> list[WorkerState]:
        """The available workers of ``role`` that serve ``lora`` (None: the base model)."""
        return [
            w
            for w in self.workers.values()
            if w.info.role is role and w.available and w.serves(lora)
        ]

    def get(self, worker_id: str) -> WorkerState | None:
        return self.workers.get(worker_id)

    def retired(self, state: WorkerState) -> bool:
        """``state`` is no longer the pool's (it left or restarted): its channel is
        closing, so new calls on it fail."""
        return self.workers.get(state.worker_id) is not state

    async def _loop(self) -> None:
        """A refresh every ``refresh_s``, counted from the start of the previous one: a
        frozen worker's probe takes its whole timeout, and sleeping ``refresh_s`` after
        that doubled the time between the probes that decide it is stalled."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at = max(next_at + self.refresh_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
            try:
                await self.refresh()
            except Exception:
                logger.exception("worker refresh failed")

    async def refresh(self) -> None:
        """Sync with the registry, then check health and load of every worker."""
        try:
            listed = await asyncio.to_thread(self.registry.list_workers)
        except Exception as exc:
            self._registry_outage.failed(exc)
            listed = [w.info for w in self.workers.values()]
        else:
            self._registry_outage.succeeded()
        current = {info.worker_id: info for info in listed if self._fits(info)}
        misfits = {info.worker_id for info in listed} - current.keys()
        now = time.monotonic()
        for worker_id in list(self.workers):
            state = self.workers[worker_id]
            if worker_id in current:
                state.missing_since = None
                continue
            if state.missing_since is None:
                state.missing_since = now
            if (
                state.healthy
                and worker_id not in misfits  # listed, restarted with another block size
                and now - state.missing_since < self.missing_grace_s
            ):
                continue  # still answering: probably back at its next heartbeat
            del self.workers[worker_id]
            self.events.remove(worker_id)
            logger.info("worker %s left", worker_id)
            self._retire(state)
            if state.calls:
                self._departed[worker_id] = state
        for worker_id, info in current.items():
            state = self.workers.get(worker_id)
            if state is None or (state.info.engine_id != info.engine_id and info.engine_id):
                if state is not None:  # restarted: its cache is new
                    self._retire(state)
                back = self._departed.get(worker_id)
                if state is None and back is not None and back.info.engine_id == info.engine_id:
                    # The same engine back in the registry (Redis lost its keys, say) while
                    # its calls still run: keep its state, so those calls keep counting on
                    # the load figures new placements read; new calls get a new channel.
                    self.workers[worker_id] = self._reconnect(back, info)
                else:
                    self.workers[worker_id] = self._connect(info)
                    if state is not None:
                        # Restarted: the router's line for it and the sequences it counts
                        # as ahead (still in flight here) belong to the worker id, not to
                        # the engine; a fresh Ahead let the old line through unbounded.
                        fresh = self.workers[worker_id]
                        fresh.gate, fresh.ahead = state.gate, state.ahead
                self.events.add(info)
                logger.info("worker %s joined (%s)", worker_id, info.role)
            else:
                state.info = info
        for worker_id, state in list(self._departed.items()):
            if not state.calls or worker_id in self.workers:
                del self._departed[worker_id]
                channel, state.departed_channel = state.departed_channel, None
                if channel is not None:  # (a state back in the pool may leave again)
                    await channel.close()
        await asyncio.gather(
            *(self._probe(state) for state in self.workers.values()),
            *(self._probe_departed(state) for state in self._departed.values()),
        )

    def _fits(self, info: WorkerInfo) -> bool:
        """Whether ``info``'s worker may join: its block size, model and connector are the
        router's (one logged error per engine otherwise; it stays out, as if
        unregistered)."""
        for what, ours, theirs, fix in (
            ("block size", self.block_size, info.block_size,
             "start it with the deployment's engine.block_size"),
            ("model", self.model, info.model,
             "another deployment's? give each its own registry.key_prefix"),
            ("connector", self.connector, info.connector,
             "start it with the deployment's kv_transfer.connector"),
        ):  # fmt: skip
            if not ours or not theirs or ours == theirs:
                continue
            if (info.worker_id, info.engine_id) not in self._mismatched:
                self._mismatched.add((info.worker_id, info.engine_id))
                logger.error("worker %s has %s %s, the router %s: not placing on it (%s)",
                             info.worker_id, what, theirs, ours, fix)  # fmt: skip
            return False
        return True

    async def _probe_departed(self, state: WorkerState) -> None:
        """Its own channel is closing (``_retire``), so the probe gets a fresh one."""
        if state.departed_channel is None:
            state.departed_channel = self.auth.aio_channel(state.info.grpc_address)
        health = health_pb2_grpc.HealthStub(state.departed_channel)
        try:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            state.answered()
        except grpc.aio.AioRpcError:
            self._give_up_if_stalled(state)

    def _retire(self, state: WorkerState) -> None:
        """No new calls go to ``state``; the ones in flight may finish. A worker can leave
        the registry while it still serves (its entry expired, say, or Redis lost its
        keys): closing the channel at once would cut those streams short. So the channel
        closes with a grace period as long as a request may last."""
        task = asyncio.create_task(state.channel.close(grace=self.request_timeout_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _connect(self, info: WorkerInfo) -> WorkerState:
        options = DECODE_CHANNEL_OPTIONS if info.role is Role.DECODE else _CHANNEL_OPTIONS
        channel = self.auth.aio_channel(info.grpc_address, options=options)
        return WorkerState(
            info=info,
            channel=channel,
            prefill=pb_grpc.PrefillServiceStub(channel) if info.role is Role.PREFILL else None,
            decode=pb_grpc.DecodeServiceStub(channel) if info.role is Role.DECODE else None,
            health=health_pb2_grpc.HealthStub(channel),
        )

    def _reconnect(self, state: WorkerState, info: WorkerInfo) -> WorkerState:
        """``state`` with a fresh channel (its own is closing: ``_retire``)."""
        fresh = self._connect(info)
        state.info, state.channel, state.health = info, fresh.channel, fresh.health
        state.prefill, state.decode = fresh.prefill, fresh.decode
        return state

    async def _probe(self, state: WorkerState) -> None:
        lora_version = state.lora_version
        try:
            reply = await state.health.Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
            healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            # Asked out of service too, its Stats says whether that is a drain (planned),
            # which a static registry has no flag for; kept only from a serving worker,
            # whose engine id is the one to compare a restart's with.
            stats = await state.stub.Stats(pb.StatsRequest(), timeout=PROBE_TIMEOUT_S)
            draining = stats.draining
            if healthy:
                if state.stats.engine_id and stats.engine_id != state.stats.engine_id:
                    # Restarted behind the same address: its cache and event stream are new.
                    logger.info("worker %s restarted", state.worker_id)
                    self.events.add(state.info)
                state.stats = stats
                if state.lora_version == lora_version:
                    state.lora_adapters = {a.name: a.fingerprint for a in stats.lora_adapters}
            state.answered()
        except grpc.aio.AioRpcError as exc:
            healthy = draining = False
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                # Answering, but not to this router: the tokens differ (common/internal_auth)
                if not state.refuses_us:
                    logger.error("worker %s refuses this router's calls: %s (is %s the same "
                                 "in every process?)", state.worker_id, exc.details(),
                                 TOKEN_ENV)  # fmt: skip
                state.refuses_us = True
            else:
                self._give_up_if_stalled(state)
                self._say_if_never_reached(state)
        if healthy != state.healthy:
            planned = draining or state.info.draining  # (no alarm)
            log = logger.info if healthy or planned else logger.warning
            said = "up" if healthy else "draining" if planned else "down"
            log("worker %s is %s", state.worker_id, said)
        state.healthy = healthy

    def _say_if_never_reached(self, state: WorkerState) -> None:
        """One warning for a worker in the registry that has answered no probe for
        ``stall_timeout_s`` since it joined: a wrong advertised address, a firewall. It
        starts down, so it never went down, and nothing was said while it was skipped."""
        silent_s = time.monotonic() - state.answered_at
        if state.ever_answered or state.said_unreachable or silent_s < self.stall_timeout_s:
            return
        state.said_unreachable = True
        logger.warning("worker %s has not answered since it joined %.0f s ago: can this "
                       "router reach %s?", state.worker_id, silent_s,
                       state.info.grpc_address)  # fmt: skip

    def _give_up_if_stalled(self, state: WorkerState) -> None:
        """A worker that has answered no probe for ``stall_timeout_s`` (frozen: a stopped
        process, a frozen host) gets its calls in flight cancelled, so their clients get an
        error (or a retry elsewhere) instead of waiting out the request timeout. A dead
        worker's calls fail by themselves; a frozen one's never would. (A hung device is
        the worker's own watchdog's: ``engine.step_timeout_s``.) The silence counts from
        its last answer, not from the first miss, which came a probe timeout and up to a
        refresh later; one missed probe alone (a slow reply) never cuts anything."""
        state.missed_probes += 1
        silent_s = time.monotonic() - state.answered_at
        pending = state.calls - state.abandoned
        if state.missed_probes < 2 or silent_s < self.stall_timeout_s or not pending:
            return
        logger.error("worker %s has not answered for %.1f s; failing its %d calls",
                     state.worker_id, silent_s, len(pending))  # fmt: skip
        for call in pending:
            state.abandoned.add(call)
            call.cancel()

    def mark_unhealthy(self, worker_id: str, draining: bool = False) -> None:
        """A call to the worker failed as if it were down (``draining``: it turned the
        call away as planned): skip it until the next probe. Said here (the probe then
        finds it down already, and said nothing), a drain as the planned thing it is."""
        state = self.workers.get(worker_id)
        if state is not None and state.healthy:
            log = logger.info if draining else logger.warning
            log("worker %s is %s", worker_id, "draining" if draining else "down (a call failed)")
            state.healthy = False
