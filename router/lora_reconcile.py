"""Bringing the workers to the routers' shared LoRA intents (``common/lora_intents.py``),
at every refresh of every router: a worker that lacks a loaded adapter (it joined, or
restarted: a runtime load does not survive that) gets it before it serves requests of
it; one that still serves an unloaded adapter (it was unreachable when the adapter went)
has it unloaded. An adapter being unloaded (``RETIRING``) is left alone: the router
unloading it does so once its requests of it have ended.

The worker calls are idempotent, so routers reconciling at once agree. Each problem is
said once per worker engine and intent (``seq``), not at every refresh: a line a second,
for ever, per adapter. Also the worker calls a load and an unload make
(``load_on``, ``unload_from``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping

import grpc

from common.lora_intents import LoraIntent, LoraIntentState
from proto import PARAM_KEY
from proto import pdserve_pb2 as pb
from router.workers import WorkerPool, WorkerStalled, WorkerState

logger = logging.getLogger(__name__)

# Reading an adapter is a few hundred MB at most; a worker busy stepping answers the RPC
# between steps. A frozen worker's call ends sooner: the pool gives up on it after its
# stall timeout (every call here is tracked, as requests' are).
LOAD_TIMEOUT_S = 120.0


async def load_on(worker: WorkerState, name: str, path: str) -> pb.LoadLoraAdapterResponse:
    request = pb.LoadLoraAdapterRequest(name=name, path=path)
    call = worker.stub.LoadLoraAdapter(request, timeout=LOAD_TIMEOUT_S)
    with worker.tracking(call):
        return await call


async def unload_from(workers: list[WorkerState], name: str, log: bool = True) -> list[str]:
    """Unload ``name`` from ``workers``; the ids of those that did not answer (each logged
    unless ``log`` is False: the reconcile says its own, once)."""

    async def unload(worker: WorkerState) -> None:
        request = pb.UnloadLoraAdapterRequest(name=name)
        call = worker.stub.UnloadLoraAdapter(request, timeout=LOAD_TIMEOUT_S)
        with worker.tracking(call):
            await call
        worker.set_lora_adapters({n: fp for n, fp in worker.lora_adapters.items() if n != name})

    results = await asyncio.gather(*map(unload, workers), return_exceptions=True)
    failed = []
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, BaseException):
            if log:
                logger.warning("unloading LoRA adapter %s from %s failed: %s",
                               name, worker.worker_id, detail(result))  # fmt: skip
            failed.append(worker.worker_id)
    return failed


class LoraReconciler:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        # (engine id, name, seq) of workers found to read other files at a loaded
        # adapter's path (changed on disk since), or that refused its files (gone,
        # unreadable): not retried until it is loaded again (a new intent).
        self._changed: set[tuple[str, str, int]] = set()
        # (engine id, name, seq, what) of problems already said; each is retried at
        # every refresh, said once until it ends.
        self._said: set[tuple[str, str, int, str]] = set()

    async def run(self, intents: Mapping[str, LoraIntent], configured: Collection[str]) -> None:
        """Bring every available worker to ``intents``, all at once: one by one, a worker
        that froze before answering held every other one's catch-up (a restarted worker
        serving no requests of the adapter meanwhile) for as long as its call took.
        Names in ``configured`` are the config's to decide: left alone."""
        current = {(intent.name, intent.seq) for intent in intents.values()}
        self._changed = {entry for entry in self._changed if entry[1:] in current}
        self._said = {said for said in self._said if said[1:3] in current}
        mine = [intent for name, intent in intents.items() if name not in configured]
        loaded = [intent for intent in mine if intent.loaded]
        unloaded = [intent for intent in mine if intent.state is LoraIntentState.UNLOADED]
        if not loaded and not unloaded:
            return
        workers = [w for w in self.pool.workers.values() if w.available]
        results = await asyncio.gather(
            *(self._reconcile_one(worker, loaded, unloaded) for worker in workers),
            return_exceptions=True,
        )
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, Exception):
                logger.warning("reconciling LoRA adapters on %s failed: %s",
                               worker.worker_id, detail(result))  # fmt: skip

    async def _reconcile_one(
        self, worker: WorkerState, loaded: list[LoraIntent], unloaded: list[LoraIntent]
    ) -> None:
        # Unloads first: a stale adapter may hold the slot a missed load needs.
        for intent in unloaded:
            if intent.name in worker.lora_adapters:
                await self._unload_stale(worker, intent)
        for intent in loaded:
            await self._catch_up(worker, intent)

    async def _unload_stale(self, worker: WorkerState, intent: LoraIntent) -> None:
        said = (_engine(worker), intent.name, intent.seq, "unload")
        if not await unload_from([worker], intent.name, log=False):
            self._said.discard(said)
            logger.info("LoRA adapter %s unloaded from %s, which still served it",
                        intent.name, worker.worker_id)  # fmt: skip
        elif said not in self._said:
            self._said.add(said)
            logger.warning("unloading LoRA adapter %s from %s, which still serves it, failed "
                           "(retried at each refresh, said once)", intent.name,
                           worker.worker_id)  # fmt: skip

    async def _catch_up(self, worker: WorkerState, want: LoraIntent) -> None:
        name, have = want.name, worker.lora_adapters.get(want.name)
        changed = (_engine(worker), name, want.seq)
        if have == want.fingerprint:
            self._said.discard((*changed, "other files"))
            return
        if changed in self._changed:
            return
        if have is not None:  # other files under the name: loaded outside the intents
            if (*changed, "other files") not in self._said:
                self._said.add((*changed, "other files"))
                logger.warning("worker %s serves LoRA adapter %s with other files (%s, not "
                               "%s)", worker.worker_id, name, have, want.fingerprint)  # fmt: skip
            return
        try:
            reply = await load_on(worker, name, want.path)
        except (grpc.aio.AioRpcError, WorkerStalled) as exc:
            self._load_failed(worker, want, exc)
            return
        self._said.discard((*changed, "load"))
        if reply.adapter.fingerprint != want.fingerprint:  # the files changed on disk
            logger.error("LoRA adapter %s at %s is not the files loaded before (%s, now %s), "
                         "so %s does not serve it; to serve the new files everywhere, unload "
                         "it and load it again", name, want.path, want.fingerprint,
                         reply.adapter.fingerprint, worker.worker_id)  # fmt: skip
            self._changed.add(changed)
            if not reply.already_loaded:
                await unload_from([worker], name)
            return
        worker.set_lora_adapters({**worker.lora_adapters, name: want.fingerprint})
        logger.info("LoRA adapter %s loaded on %s, which lacked it", name, worker.worker_id)

    def _load_failed(self, worker: WorkerState, want: LoraIntent, exc: BaseException) -> None:
        """Say a failed catch-up once, not at every refresh; refused files are not asked
        for again until the adapter is loaded again (no retry will do until they change).
        The worker's limit of adapters is refused too, but passes: retried."""
        changed = (_engine(worker), want.name, want.seq)
        if refused_files(exc):
            self._changed.add(changed)
            logger.error("%s cannot load LoRA adapter %s: %s; not retried there until the "
                         "adapter is loaded again (restore its files at %s and load it, or "
                         "unload it)", worker.worker_id, want.name, detail(exc),
                         want.path)  # fmt: skip
        elif (*changed, "load") not in self._said:
            self._said.add((*changed, "load"))
            logger.warning("loading LoRA adapter %s on %s failed (retried at each refresh, "
                           "said once): %s", want.name, worker.worker_id,
                           detail(exc))  # fmt: skip


def _engine(worker: WorkerState) -> str:
    """The worker's engine (a restart makes a new one), else its id."""
    return worker.stats.engine_id or worker.worker_id


def refused_files(exc: BaseException) -> bool:
    """Whether a worker refused an adapter's files (missing, unreadable, another base):
    the worker names ``lora_path``. Its limit of adapters is refused too, but passes."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    return exc.code() is grpc.StatusCode.INVALID_ARGUMENT and any(
        key == PARAM_KEY and value == "lora_path" for key, value in exc.trailing_metadata() or ()
    )


def detail(exc: BaseException) -> str:
    """What a failed call to a worker says: the RPC's details, else the exception (the
    pool's ``WorkerStalled``, say)."""
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
