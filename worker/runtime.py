"""One worker process: the engine on its thread, its connector, KV events, registry entry,
gRPC server with health, and graceful drain. Both roles run this; they differ only in the
servicer they add and in which half of the connector they use.

Lifecycle:

    start():  gRPC server up (health NOT_SERVING) → model + KV cache loaded (in a thread,
              health keeps answering) → connector registered → engine thread started →
              registered in the registry, heartbeat running → SERVING
    drain():  NOT_SERVING + registry entry marked draining → new requests get UNAVAILABLE
              → wait (at most drain_grace_s) for in-flight work → deregister → stop
              (a drain during start waits for the load, and the worker never serves)
    engine failure: open streams fail at once, NOT_SERVING → deregister → stop, and the
              process exits 1 (to be restarted)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.config import FailurePolicy, PdserveConfig, Role
from common.config_base import ConfigError
from common.engine_config import EngineConfig, StateDType
from common.event_bus import KVEventPublisher
from common.gc_heap import freeze_startup_heap
from common.hosts import host_port
from common.internal_auth import NO_AUTH, InternalAuth
from common.listen_sockets import port_in_use, worker_listeners
from common.outage_log import OutageLog
from common.registry import Registry, WorkerInfo, create_registry, worker_id
from common.tracing import Tracer
from engine.async_engine import AsyncEngine
from engine.kv_events import KVEventCollector
from engine.llm_engine import LLMEngine
from engine.models.arch import read_arch_config
from engine.models.fingerprint import weights_fingerprint
from engine.parallel.launch import ShardExtensionSpec
from engine.resolve import resolve_device, resolve_dtype
from kv_transfer import KVConnector, KVTransferConfig, create_connector
from worker.connector_puller import ConnectorPuller
from worker.grpc_errors import DrainingError, quiet_cancelled_writes
from worker.peer_metadata import PeerMetadataClient
from worker.stats import StageTimer
from worker.tp_connector import (
    EXTENSION,
    MESSAGE_TYPES,
    TensorParallelConnector,
    rank_config,
    settings_bytes,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

_EVENT_HEARTBEAT_S = 1.0
_ENGINE_WATCH_S = 0.5  # how soon a failed engine takes the worker out of service


def model_namespace(model_dir: Path, state_dtype: StateDType = StateDType.FLOAT32) -> str:
    """A directory-safe name per model and weights, so shared-storage files of different
    models (or of one model's old weights) with equal token prefixes never mix. LoRA
    adapters need no part in it: their blocks' names are salted with their own weights
    (``engine.models.lora.LoraAdapter.key``), which also covers adapters loaded later.
    A hybrid model's state files hold raw states in ``engine.linear_state_dtype``, which
    the KV layout does not name: a 16-bit one gets its own namespace (a deployment moved
    to bfloat16 read the float32 files an earlier one left, as bfloat16: NaN log-probs,
    and no error)."""
    name = f"{model_dir.name}-{weights_fingerprint(model_dir)}"
    return name if state_dtype is StateDType.FLOAT32 else f"{name}-states-{state_dtype.value}"


def kv_namespace(engine: EngineConfig, model_dir: Path) -> str:
    """``model_namespace``, and, where the KV cache rounds what the model computes (fp8),
    the dtype that computed it: in every KV handle (a decode worker of another computes
    the prompt itself, at once) and in the shared-storage directory. Two deployments of
    one model under one directory, float32 and bfloat16 with an fp8 cache, read each
    other's blocks (the second found the first's and wrote none): 4 of 4 of its replies
    changed, with no error. (A deployment's roles compute in one dtype: the config
    check; this catches hosts whose auto differs, and a rolling upgrade.)"""
    name = model_namespace(model_dir, engine.linear_state_dtype)
    if engine.kv_cache_dtype.storage_name is None:  # the KV element is the dtype itself
        return name
    computed = resolve_dtype(engine, read_arch_config(model_dir), resolve_device(engine))
    return f"{name}-computed-{str(computed).removeprefix('torch.')}"


class WorkerRuntime:
    def __init__(
        self, config: PdserveConfig, role: Role, index: int, auth: InternalAuth = NO_AUTH
    ) -> None:
        """``auth``: the token every call but the health service's must carry (and this
        worker's own calls to its peers do)."""
        self.config = config
        self.auth = auth
        self.role = role
        self.index = index
        section = config.role(role)
        # With the Redis registry, workers beyond the configured count may join (scale-out);
        # with the static list, the router only knows the configured ones.
        dynamic = config.registry.redis_url is not None
        if index < 0 or (not dynamic and index >= max(section.replicas, 1)):
            raise ValueError(f"{role}.replicas is {section.replicas}: no replica {index}")
        self.host = section.host
        self.ports = section.ports(index)
        self.engine_id = f"{role.value}-{index}-{uuid.uuid4().hex[:8]}"
        self.worker_id = worker_id(role, self.host, self.ports.grpc)
        self.address = host_port(self.host, self.ports.grpc)
        self.tracer = Tracer(config.tracing, f"pdserve-{role.value}", self.worker_id)
        self.ready = False
        self.draining = False
        self.timer = StageTimer()
        self.async_engine: AsyncEngine | None = None
        self.connector: KVConnector | None = None
        self.publisher: KVEventPublisher | None = None
        self.registry: Registry | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.metadata_by_rank: list[bytes] = []  # the connector handshake of each TP rank
        # Its model, weights, state dtype and (fp8 cache) compute dtype (``kv_namespace``),
        # once loaded: in every KV handle, so that a decode worker of other weights or
        # arithmetic does not use the blocks.
        self.model_namespace = ""
        self.engine: LLMEngine | None = None
        self._metadata_client = PeerMetadataClient(config.kv_transfer.timeout_s, auth=auth)
        self._heartbeat_task: asyncio.Task | None = None
        self._registry_outage = OutageLog(logger, "registry heartbeats failing")
        # Registry calls run in order on one thread: a heartbeat still running in its
        # thread when ``stop`` deregistered found the entry gone and registered it again.
        self._registry_thread = ThreadPoolExecutor(1, thread_name_prefix="registry")
        self.engine_failed = False  # its thread stopped after a step raised
        self.exit_code = 0  # 1 once the engine failed: the process exits to be restarted
        self._failure_stop: asyncio.Task | None = None
        self._start_done = asyncio.Event()  # start returned or raised
        self._stopped = asyncio.Event()

    # ------------------------------------------------------------------ start

    async def start(
        self, add_servicer: Callable[[grpc.aio.Server], None], freeze_heap: bool = False
    ) -> bool:
        """Start serving; False if ``drain`` was called before the model finished loading
        (the worker then never turns SERVING, and the drain releases what was built).
        ``freeze_heap``: the process is this worker's own, so what it holds once loaded
        can leave the garbage collector's passes before it serves (``common/gc_heap.py``;
        not in a test's process, whose later garbage would be kept)."""
        try:
            return await self._start(add_servicer, freeze_heap)
        finally:
            self._start_done.set()

    async def _start(
        self, add_servicer: Callable[[grpc.aio.Server], None], freeze_heap: bool
    ) -> bool:
        # The registry first: an unreachable Redis fails the start before the model loads.
        self.registry = await self._in_registry(create_registry, self.config)
        # A request may carry images (a vision-language model's): up to the router's
        # request budget, and its prompt's ids, not gRPC's default of 4 MiB.
        limit = max(64 << 20, self.config.router.max_request_bytes + (32 << 20))
        quiet_cancelled_writes()
        self.server = grpc.aio.server(
            # gRPC turns SO_REUSEPORT on by default: a second worker started on a serving
            # one's port bound it too, took a share of its calls (health probes answered
            # NOT_SERVING) while it loaded, and failed only later, on its events port.
            options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)],
            interceptors=self.auth.server_interceptors(),
        )
        add_servicer(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bound = self.server.add_insecure_port(self.address)
        except RuntimeError:  # (newer gRPC raises where older returned 0)
            bound = 0
        if bound == 0:
            raise ConfigError(f"{self.role.value}.port", f"cannot listen on {self.address}: "
                              "the port is in use (or the host is not this machine's)")  # fmt: skip
        # Its other ports too, before the model loads: they are bound only after it (a
        # port in use failed then, with a traceback, or hung the NCCL connector's exit).
        others = worker_listeners(self.ports, self.config.kv_transfer.connector)[1:]
        busy = port_in_use(self.host, others)
        if busy is not None:
            raise ConfigError(f"{self.role.value}.port", f"cannot listen on {busy}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        logger.info("%s listening on %s, loading the model", self.worker_id, self.address)
        await asyncio.get_running_loop().run_in_executor(None, self._build_engine)
        if self.draining:
            logger.info("%s told to stop while loading; not serving", self.worker_id)
            return False
        if freeze_heap:
            freeze_startup_heap()
        await self._in_registry(self.registry.register, self.info())
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        self.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s ready (engine %s)", self.worker_id, self.engine_id)
        return True

    def _build_engine(self) -> None:
        from engine.models.maker import ensure_model

        model_dir = Path(self.config.model) if self.config.model else ensure_model()
        adapters = {name: Path(path) for name, path in self.config.lora.adapters.items()}
        transfer = self.config.kv_transfer
        engine_config = self.config.engine_for(self.role)
        tp_size = engine_config.tensor_parallel_size
        self.model_namespace = kv_namespace(engine_config, model_dir)
        connector_config = rank_config(
            KVTransferConfig(
                connector=transfer.connector,
                host=self.host,
                port=self.ports.kv_transfer,
                store_port=self.ports.kv_store,
                timeout_s=transfer.timeout_s,
                shared_dir=transfer.shared_dir,
                shared_namespace=self.model_namespace,
                shared_max_bytes=transfer.shared_max_bytes,
                nixl_read_lanes=transfer.nixl_read_lanes,
                nixl_pin_lanes=transfer.nixl_pin_lanes,
            ),
            0,
            tp_size,
        )
        local = create_connector(connector_config, self.engine_id, self._metadata_client)
        # Tensor parallelism: every rank moves its own KV heads with its own connector
        # (worker/tp_connector.py), built in its shard process as an extension.
        tp_connector = TensorParallelConnector(local, tp_size) if tp_size > 1 else None
        extension = None
        if tp_connector is not None:
            extension = ShardExtensionSpec(
                EXTENSION, settings_bytes(connector_config, self.engine_id), MESSAGE_TYPES
            )
        self.connector = tp_connector or local
        puller = None
        if self.role is Role.DECODE:
            puller = ConnectorPuller(self.connector, self._metadata_client.release_lease)
        collector = KVEventCollector()
        engine = LLMEngine(
            model_dir,
            engine_config,
            kv_events=collector,
            kv_puller=puller,
            recompute_on_pull_failure=transfer.failure_policy is FailurePolicy.RECOMPUTE,
            lora_adapters=adapters,
            shard_extension=extension,
        )
        self.engine = engine  # closed at stop: it holds the shard processes
        engine.grammars.warm_up()  # before serving: not on the first structured request
        self.connector.register_kv_caches(engine.runner.kv_caches)
        self.metadata_by_rank = [self.connector.metadata()]
        if tp_connector is not None:
            tp_connector.attach(engine.runner.shards, engine.runner.shard_payloads)
            self.metadata_by_rank = tp_connector.metadata_by_rank()
            engine.runner.shards.on_failure.append(self._shard_failed)
        self.model_dir = model_dir
        self.puller = puller
        self.publisher = KVEventPublisher(self.host, self.ports.events, self.ports.replay)
        self.async_engine = AsyncEngine(engine)
        self.async_engine.hooks.append(self._events_hook(collector))
        self.async_engine.start()
        shards = engine.runner.shards
        if shards is not None and shards.failure is not None:  # a rank died while starting
            self._shard_failed(shards.failure)

    def _shard_failed(self, reason: str) -> None:
        """A tensor-parallel shard failed or died (its watcher thread): the engine cannot
        step any more; fail it now, so the worker leaves service and exits (restarted)."""
        if self.async_engine is not None:
            self.async_engine.fail_stuck(reason)

    def _events_hook(self, collector: KVEventCollector) -> Callable[[], None]:
        publisher = self.publisher
        assert publisher is not None
        last_beat = [0.0]

        def publish() -> None:
            publisher.publish(collector.drain())
            now = time.monotonic()
            if now - last_beat[0] >= _EVENT_HEARTBEAT_S:
                publisher.heartbeat()
                last_beat[0] = now

        return publish

    def info(self) -> WorkerInfo:
        engine = self.async_engine.engine if self.async_engine else None
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            grpc_address=self.address,
            events_endpoint=f"tcp://{host_port(self.host, self.ports.events)}",
            replay_endpoint=f"tcp://{host_port(self.host, self.ports.replay)}",
            model=self.config.model or "demo",
            engine_id=self.engine_id,
            kv_blocks_total=engine.runner.num_blocks if engine else 0,
            block_size=self.config.engine_for(self.role).block_size,
            connector=self.config.kv_transfer.connector,
            draining=self.draining or self.engine_failed,
        )

    async def _heartbeat(self) -> None:
        interval = self.config.registry.heartbeat_s
        while True:
            await self._wait_or_engine_failed(interval)
            if self.engine_failed:
                # Its state is untrusted and it serves nothing more: deregister and exit
                # non-zero, so the launcher, compose or Kubernetes starts a fresh one
                # instead of a live process holding the capacity for good.
                self.exit_code = 1
                self._failure_stop = asyncio.create_task(self.stop())
                return
            try:
                await self._in_registry(self.registry.heartbeat, self.info())
            except Exception as exc:  # a registry outage must not kill the worker
                self._registry_outage.failed(exc)
            else:
                self._registry_outage.succeeded()

    async def _in_registry(self, call: Callable[..., T], *args: object) -> T:
        """``call(*args)`` on the registry's thread, after the calls before it."""
        return await asyncio.get_running_loop().run_in_executor(self._registry_thread, call, *args)

    async def _wait_or_engine_failed(self, interval_s: float) -> None:
        """Sleep ``interval_s``, watching the engine: once its thread has failed, or has
        spent more than ``engine.step_timeout_s`` in one step (a hung device: health and
        Stats would still answer from this thread), this worker takes no more requests
        (health NOT_SERVING, listed as draining), so routers stop sending it work instead
        of waiting on it."""
        deadline = time.monotonic() + interval_s
        step_timeout_s = self.config.engine_for(self.role).step_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(min(_ENGINE_WATCH_S, interval_s))
            engine = self.async_engine
            if (
                engine is not None
                and engine.failure is None
                and step_timeout_s is not None
                and engine.busy_for_s() > step_timeout_s
            ):
                engine.fail_stuck(f"one engine step ran past {step_timeout_s:g} s: device hung?")
            if engine is not None and engine.failure is not None and not self.engine_failed:
                logger.error("%s: engine failed (%s); taking no more work", self.worker_id,
                             engine.failure)  # fmt: skip
                self.engine_failed = True
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                return

    async def _set_health(self, status: int) -> None:
        for service in ("", self._service_name()):
            await self.health.set(service, status)

    def _service_name(self) -> str:
        return f"pdserve.v1.{'Prefill' if self.role is Role.PREFILL else 'Decode'}Service"

    # ------------------------------------------------------------------ requests

    def check_ready(self) -> AsyncEngine:
        """The engine, once started (draining included: in-flight work still needs it)."""
        if not self.ready or self.async_engine is None:
            raise DrainingError(f"{self.worker_id} is still starting", "starting")
        return self.async_engine

    def check_accepting(self) -> AsyncEngine:
        """The engine, if this worker takes new requests; raises ``DrainingError`` else."""
        if self.draining or self.engine_failed:
            if self.draining:
                raise DrainingError(f"{self.worker_id} is draining")
            raise DrainingError(f"{self.worker_id} is out of service (its engine failed)",
                                "engine_failed")  # fmt: skip
        return self.check_ready()

    # ------------------------------------------------------------------ stop

    async def drain(self, in_flight: Callable[[], int]) -> None:
        """Stop taking work, let in-flight work finish (bounded by the grace period), and
        shut down."""
        if self.draining:
            return
        self.draining = True
        # A drain during start waits for it (model loading cannot be interrupted); start
        # sees the flag and gives up before serving, and nothing is in flight then.
        await self._start_done.wait()
        grace_s = self.config.role(self.role).drain_grace_s
        logger.info("%s draining (grace %.0fs)", self.worker_id, grace_s)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.ready and self.registry is not None:
            try:
                await self._in_registry(self.registry.register, self.info())
            except Exception as exc:
                logger.warning("could not mark the registry entry draining: %s", exc)
        deadline = time.monotonic() + grace_s
        while in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if in_flight():
            logger.warning(
                "%s: %d requests still in flight after the grace period",
                self.worker_id,
                in_flight(),
            )
        else:
            logger.info("%s drained; stopping", self.worker_id)
        await self.stop()

    async def stop(self) -> None:
        """Release everything started so far, once. Servicers may still read the engine
        and connector afterwards (a request past the grace period), so they stay set."""
        if self._stopped.is_set():
            return
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self.registry is not None:
            try:
                await self._in_registry(self.registry.deregister, self.worker_id)
            except Exception as exc:
                logger.warning("could not deregister: %s", exc)
            self.registry.close()
        self._registry_thread.shutdown(wait=False)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.async_engine is not None:
            self.async_engine.stop()
        if self.connector is not None:
            self.connector.close()
        if self.engine is not None:
            self.engine.close()
        if self.publisher is not None:
            self.publisher.close()
        self._metadata_client.close()
        await asyncio.to_thread(self.tracer.shutdown)  # the last spans, sent
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
