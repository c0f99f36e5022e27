"""LoRA adapters as the router sees them: which names a client may ask for, which files a
request of one runs with, and loading and unloading them while serving (vLLM's
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, with
``lora.runtime_loading``).

The workers are the truth: each Stats lists the adapters a worker serves, by name and
fingerprint of its files (``WorkerState.lora_adapters``). A request of adapter ``alice``
runs with the fingerprint most available workers serve it with (``resolve``), only on
workers serving that one (``WorkerPool.candidates``), and its block hashes are salted with
that fingerprint as the workers' are, so prefix-aware placement keeps working.

A load goes to every available worker, prefill and decode alike (a request's KV is
computed with its adapter on one and continued with it on the other); it succeeds only if
every one loaded the same files, and is undone on those that loaded it if not. Loads
through this router are also its desired state: each refresh, a worker that lacks one (it
joined since, or restarted: a runtime load does not survive a restart) gets it before
it serves requests of it, and a worker that still serves an adapter unloaded through this
router (it was unreachable then) has it unloaded (``reconcile``). With several routers,
load and unload each adapter through one of them; the others see it in Stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import grpc

from common.config import LORA_NAME_RULE, LoraSettings, valid_lora_name
from proto import PARAM_KEY
from proto import pdserve_pb2 as pb
from router.errors import APIError, bad_request, model_not_found, unavailable
from router.once import once
from router.workers import LoraRef, WorkerPool, WorkerStalled, WorkerState

logger = logging.getLogger(__name__)

# Reading an adapter is a few hundred MB at most; a worker busy stepping answers the RPC
# between steps. A frozen worker's call ends sooner: the pool gives up on it after its
# stall timeout (every call here is tracked, as requests' are).
LOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class _Loaded:
    path: str  # as the workers see it
    fingerprint: str


class LoraAdapters:
    def __init__(self, settings: LoraSettings, pool: WorkerPool, base_name: str) -> None:
        self.settings = settings
        self.pool = pool
        self.base_name = base_name  # the base model's served name: no adapter takes it
        # Loaded through this router and not unloaded since: kept on every worker.
        self.loaded: dict[str, _Loaded] = {}
        # Unloaded through this router and not loaded since: kept off every worker.
        self.unloaded: set[str] = set()
        # Being unloaded: refused to new requests while this router's in flight finish.
        self.retiring: set[str] = set()
        self._inflight: Counter[str] = Counter()  # sequences of each adapter, admitted here
        # (engine id, name) of workers found to read other files at a loaded adapter's
        # path (changed on disk since), or that refused its files (gone, unreadable): not
        # retried until it is loaded again.
        self._changed: set[tuple[str, str]] = set()
        # (engine id, name, what) of reconcile problems already said: each is retried at
        # every refresh (a line a second, for ever, per adapter), said once until it ends.
        self._said: set[tuple[str, str, str]] = set()
        self._lock = asyncio.Lock()  # one load, unload or reconcile at a time
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ requests

    def names(self) -> list[str]:
        """Every adapter a client may name: configured, loaded here, or served by a worker
        (and not being unloaded)."""
        names = set(self.settings.adapters) | set(self.loaded)
        for worker in self.pool.workers.values():
            if worker.available:
                names.update(worker.lora_adapters)
        return sorted(names - self.retiring)

    def path_of(self, name: str) -> str | None:
        """The directory the workers read ``name`` from, if this router loaded or
        configured it (one a worker alone serves is not known here)."""
        loaded = self.loaded.get(name)
        return loaded.path if loaded is not None else self.settings.adapters.get(name)

    def admit(self, name: str | None, num_sequences: int) -> Callable[[], None]:
        """Count ``num_sequences`` of adapter ``name`` in flight until the returned call
        (``unload`` waits for them)."""
        if name is None:
            return lambda: None
        self._inflight[name] += num_sequences

        def release() -> None:
            self._inflight[name] -= num_sequences
            if not self._inflight[name]:
                del self._inflight[name]

        return once(release)

    def resolve(self, name: str) -> LoraRef:
        """The adapter requests of ``name`` run with now: the fingerprint most available
        workers serve it with (they disagree only while a change is under way), ties to
        the one loaded here, then the smallest. 503 if no worker serves it now; 404 if it
        is being unloaded."""
        if name in self.retiring:
            raise model_not_found(name)
        counts = Counter(
            worker.lora_adapters[name]
            for worker in self.pool.workers.values()
            if worker.available and name in worker.lora_adapters
        )
        if not counts:
            raise unavailable(f"no worker serves LoRA adapter {name!r} right now")
        mine = self.loaded.get(name)
        fingerprint = max(
            sorted(counts),
            key=lambda fp: (counts[fp], mine is not None and fp == mine.fingerprint),
        )
        return LoraRef(name, fingerprint)

    # ------------------------------------------------------------------ load / unload

    async def load(self, name: str, path: str) -> dict[str, Any]:
        """Load ``path`` as ``name`` on every available worker; the reply body of the
        endpoint. Raises ``APIError``: 400 for a bad name or adapter (nothing stays
        loaded), 503 when a worker could not be reached."""
        self._check_enabled()
        if not valid_lora_name(name):
            raise bad_request(f"a LoRA adapter name is {LORA_NAME_RULE}", "lora_name")
        if name == self.base_name:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        if not path:
            raise bad_request("needs the adapter's directory (as the workers see it)", "lora_path")
        retiring = bad_request(f"LoRA adapter {name!r} is being unloaded: retry after",
                               "lora_name")  # fmt: skip
        if name in self.retiring:
            raise retiring
        async with self._lock:
            # Again, under the lock: an unload queued before this load on a held lock
            # took it first, and this load, answered 200, was then undone on every
            # worker, leaving the name both loaded and unloaded here (loaded and
            # unloaded again at every reconcile).
            if name in self.retiring:
                raise retiring
            workers = [w for w in self.pool.workers.values() if w.available]
            if not workers:
                raise unavailable("no worker is available to load the adapter on")
            served_before = {w.worker_id for w in workers if name in w.lora_adapters}
            results = await asyncio.gather(
                *(self._load_on(worker, name, path) for worker in workers),
                return_exceptions=True,
            )
            replies: list[tuple[WorkerState, pb.LoadLoraAdapterResponse]] = []
            failures: list[tuple[WorkerState, BaseException]] = []
            for worker, result in zip(workers, results, strict=True):
                if isinstance(result, pb.LoadLoraAdapterResponse):
                    replies.append((worker, result))
                else:
                    failures.append((worker, result))
            fingerprints = {reply.adapter.fingerprint for _, reply in replies}
            if failures or len(fingerprints) != 1:
                added = [w for w, reply in replies if not reply.already_loaded]
                # A worker whose call failed other than by refusing may have loaded it all
                # the same (its answer lost, or the deadline passed as it finished): undone
                # too, unless it served the name before. (A frozen one's unload ends with
                # the pool's stall give-up.)
                unsure = [w for w, exc in failures
                          if not _refused(exc) and w.worker_id not in served_before]  # fmt: skip
                await self._unload_from(added + unsure, name)  # all or nothing
                raise _load_error(failures, len(workers), fingerprints)
            (fingerprint,) = fingerprints
            for worker, _ in replies:
                worker.set_lora_adapters({**worker.lora_adapters, name: fingerprint})
            self.loaded[name] = _Loaded(path, fingerprint)
            self.unloaded.discard(name)
            self._changed = {entry for entry in self._changed if entry[1] != name}
            self._forget_said(name)
        logger.info("LoRA adapter %s loaded from %s on %d workers (%s)",
                    name, path, len(replies), fingerprint)  # fmt: skip
        return {"object": "lora_adapter", "id": name, "fingerprint": fingerprint,
                "num_workers": len(replies)}  # fmt: skip

    async def unload(self, name: str) -> dict[str, Any]:
        """Unload ``name`` from every worker that answers. New requests of it get 404 at
        once; the unload itself waits until this router's requests of it have finished
        (at most ``lora.unload_grace_s``): one between its prefill and its decode worker
        would be refused there. Requests still running after that finish with it too
        (a worker's requests hold their adapter). 404 if no worker serves it and it was
        not loaded here; 503 if a worker that serves it could not be reached (retry:
        unloading is idempotent, and ``reconcile`` keeps trying meanwhile)."""
        self._check_enabled()
        if name in self.settings.adapters:
            raise bad_request(
                f"LoRA adapter {name!r} is in lora.adapters: every worker loads it at start. "
                "Remove it from the config instead",
                "lora_name",
            )
        async with self._lock:
            held = [w for w in self.pool.workers.values() if name in w.lora_adapters]
            if name not in self.loaded and not held:
                raise APIError(404, f"LoRA adapter {name!r} is not loaded", param="lora_name",
                               code="model_not_found")  # fmt: skip
            self.loaded.pop(name, None)
            self._forget_said(name)
            self.retiring.add(name)
        try:
            deadline = time.monotonic() + self.settings.unload_grace_s
            while self._inflight[name] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._inflight[name]:
                logger.warning("unloading LoRA adapter %s with %d sequences still in flight",
                               name, self._inflight[name])  # fmt: skip
            async with self._lock:
                self.unloaded.add(name)
                workers = [w for w in self.pool.workers.values() if w.healthy]
                failed = await self._unload_from(workers, name)
        finally:
            self.retiring.discard(name)
        if failed:
            raise unavailable(
                f"LoRA adapter {name!r} could not be unloaded from {len(failed)} of "
                f"{len(workers)} workers ({', '.join(failed)}); it is no longer placed "
                "there, and the router retries"
            )
        logger.info("LoRA adapter %s unloaded from %d workers", name, len(workers))
        return {"object": "lora_adapter", "id": name, "deleted": True}

    def _check_enabled(self) -> None:
        if not self.settings.runtime_loading:
            raise APIError(
                404,
                "loading LoRA adapters at runtime is off: set lora.runtime_loading",
                code="not_found",
            )

    async def _load_on(
        self, worker: WorkerState, name: str, path: str
    ) -> pb.LoadLoraAdapterResponse:
        request = pb.LoadLoraAdapterRequest(name=name, path=path)
        call = worker.stub.LoadLoraAdapter(request, timeout=LOAD_TIMEOUT_S)
        with worker.tracking(call):
            return await call

    async def _unload_from(
        self, workers: list[WorkerState], name: str, log: bool = True
    ) -> list[str]:
        """Unload ``name`` from ``workers``; the ids of those that did not answer (each
        logged unless ``log`` is False: the reconcile says its own, once)."""

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
                                   name, worker.worker_id, _detail(result))  # fmt: skip
                failed.append(worker.worker_id)
        return failed

    # ------------------------------------------------------------------ reconcile

    def start(self, interval_s: float) -> None:
        self._task = asyncio.create_task(self._loop(interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reconcile()
            except Exception:
                logger.exception("LoRA adapter reconcile failed")

    async def reconcile(self) -> None:
        """Bring every available worker to this router's loads and unloads, all at once:
        one by one, a worker that froze before answering held every other one's catch-up
        (a restarted worker serving no requests of the adapter meanwhile) for as long as
        its call took."""
        if not self.loaded and not self.unloaded:
            return
        async with self._lock:
            workers = [w for w in self.pool.workers.values() if w.available]
            results = await asyncio.gather(*map(self._reconcile_one, workers),
                                           return_exceptions=True)  # fmt: skip
            for worker, result in zip(workers, results, strict=True):
                if isinstance(result, Exception):
                    logger.warning("reconciling LoRA adapters on %s failed: %s",
                                   worker.worker_id, _detail(result))  # fmt: skip

    def _forget_said(self, name: str) -> None:
        """A load or unload of ``name`` through this router starts its story afresh: a
        problem after it is said again."""
        self._said = {said for said in self._said if said[1] != name}

    async def _reconcile_one(self, worker: WorkerState) -> None:
        # Unloads first: a stale adapter may hold the slot a missed load needs.
        stale = [name for name in self.unloaded if name in worker.lora_adapters]
        for name in stale:
            key = (worker.stats.engine_id or worker.worker_id, name, "unload")
            if not await self._unload_from([worker], name, log=False):
                self._said.discard(key)
                logger.info("LoRA adapter %s unloaded from %s, which still served it",
                            name, worker.worker_id)  # fmt: skip
            elif key not in self._said:
                self._said.add(key)
                logger.warning("unloading LoRA adapter %s from %s, which still serves it, "
                               "failed (retried at each refresh, said once)", name,
                               worker.worker_id)  # fmt: skip
        for name, want in list(self.loaded.items()):
            await self._catch_up(worker, name, want)

    async def _catch_up(self, worker: WorkerState, name: str, want: _Loaded) -> None:
        have = worker.lora_adapters.get(name)
        changed = (worker.stats.engine_id or worker.worker_id, name)
        if have == want.fingerprint:
            self._said.discard((*changed, "other files"))
            return
        if changed in self._changed:
            return
        if have is not None:  # other files under the name: loaded through another router
            if (*changed, "other files") not in self._said:
                self._said.add((*changed, "other files"))
                logger.warning("worker %s serves LoRA adapter %s with other files (%s, not "
                               "%s)", worker.worker_id, name, have, want.fingerprint)  # fmt: skip
            return
        try:
            reply = await self._load_on(worker, name, want.path)
        except (grpc.aio.AioRpcError, WorkerStalled) as exc:
            # Said once, not at every refresh (a line a second, for ever, per adapter).
            if _refused_files(exc):  # no retry will do until they change
                self._changed.add(changed)
                logger.error("%s cannot load LoRA adapter %s: %s; not retried there until "
                             "the adapter is loaded again (restore its files at %s and load "
                             "it, or unload it)", worker.worker_id, name, _detail(exc),
                             want.path)  # fmt: skip
            elif (*changed, "load") not in self._said:  # (the worker's limit, say: it passes)
                self._said.add((*changed, "load"))
                logger.warning("loading LoRA adapter %s on %s failed (retried at each "
                               "refresh, said once): %s", name, worker.worker_id,
                               _detail(exc))  # fmt: skip
            return
        self._said.discard((*changed, "load"))
        if reply.adapter.fingerprint != want.fingerprint:  # the files changed on disk
            logger.error("LoRA adapter %s at %s is not the files loaded before (%s, now %s), "
                         "so %s does not serve it; to serve the new files everywhere, unload "
                         "it and load it again", name, want.path, want.fingerprint,
                         reply.adapter.fingerprint, worker.worker_id)  # fmt: skip
            self._changed.add(changed)
            if not reply.already_loaded:
                await self._unload_from([worker], name)
            return
        worker.set_lora_adapters({**worker.lora_adapters, name: want.fingerprint})
        logger.info("LoRA adapter %s loaded on %s, which lacked it", name, worker.worker_id)


def _load_error(
    failures: list[tuple[WorkerState, BaseException]], num_workers: int, fingerprints: set[str]
) -> APIError:
    """What a failed load tells the client: a worker's refusal as a 400 naming the field
    (a bad path or adapter, a name taken by other files, the adapter limit); workers that
    read different files at the path as a 400; an unreachable worker as a 503."""
    for worker, exc in failures:
        if _refused(exc):
            param = next((v for k, v in exc.trailing_metadata() or () if k == PARAM_KEY), None)
            return bad_request(f"{worker.worker_id}: {exc.details()}", param)
    if failures:
        worker, exc = failures[0]
        return unavailable(
            f"the adapter could not be loaded on {len(failures)} of {num_workers} workers "
            f"({worker.worker_id}: {_detail(exc)}); nothing was loaded"
        )
    return bad_request(
        f"the workers read different files at lora_path (fingerprints "
        f"{', '.join(sorted(fingerprints))}): give a path every worker sees alike",
        "lora_path",
    )


def _refused_files(exc: BaseException) -> bool:
    """Whether a worker refused an adapter's files (missing, unreadable, another base):
    the worker names ``lora_path``. Its limit of adapters is refused too, but passes."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    return exc.code() is grpc.StatusCode.INVALID_ARGUMENT and any(
        key == PARAM_KEY and value == "lora_path" for key, value in exc.trailing_metadata() or ()
    )


def _refused(exc: BaseException) -> TypeGuard[grpc.aio.AioRpcError]:
    """Whether a worker's load failed by refusing (a bad adapter, a taken name, the
    limit): nothing was loaded there."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    )


def _detail(exc: BaseException) -> str:
    """What a failed call to a worker says: the RPC's details, else the exception (the
    pool's ``WorkerStalled``, say)."""
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
