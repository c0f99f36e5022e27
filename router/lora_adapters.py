"""LoRA adapters as the router sees them: which names a client may ask for, which files a
request of one runs with, and loading and unloading them while serving (vLLM's
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, with
``lora.runtime_loading``).

The workers are the truth about what is served: each Stats lists the adapters a worker
serves, by name and fingerprint of its files (``WorkerState.lora_adapters``). A request
of adapter ``alice`` runs with the fingerprint most available workers serve it with
(``resolve``), only on workers serving that one (``WorkerPool.candidates``), and its
block hashes are salted with that fingerprint as the workers' are, so prefix-aware
placement keeps working.

A load goes to every available worker, prefill and decode alike (a request's KV is
computed with its adapter on one and continued with it on the other); it succeeds only if
every one loaded the same files, and is undone on those that loaded it if not.

What the workers should serve is shared by every router of the registry
(``common/lora_intents.py``), so a load or an unload may go through any router: a load
writes the adapter's intent ``LOADED`` once every worker loaded it, and each refresh every
router reads the intents and brings the workers to them (``router/lora_reconcile.py``): a
worker that lacks a loaded adapter (it joined, or restarted) gets it from whichever router
comes first, one that still serves an unloaded one has it unloaded. A router serves an
adapter loaded through another as its own.

An unload writes ``RETIRING`` first: every router refuses new requests of it (404) from
its next refresh. The unloading router waits two refresh intervals for them to read it,
and for its own requests of the adapter to end (``lora.unload_grace_s`` at most); then it
unloads it from the workers and writes ``UNLOADED``, a tombstone no router loads again.
Another router's requests still between their prefill and decode workers then are
refused by the decode worker, a 404 to their clients (``router/dispatch.py``). An unload
left ``RETIRING`` by a router that stopped midway is finished by any router, after
``abandoned_after_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeGuard

import grpc
import msgspec

from common.config import LORA_NAME_RULE, LoraSettings, valid_lora_name
from common.lora_intents import LoraIntent, LoraIntentState, LoraIntentStore
from common.outage_log import OutageLog
from common.registry import RegistryError
from proto import PARAM_KEY
from proto import pdserve_pb2 as pb
from router.errors import APIError, bad_request, model_not_found, unavailable
from router.lora_reconcile import LoraReconciler, detail, load_on, unload_from
from router.once import once
from router.workers import LoraRef, WorkerPool, WorkerState

logger = logging.getLogger(__name__)

# How much longer than its router's own wait an unload may stay RETIRING before another
# router takes it for abandoned: the unloading router's calls to the workers, and a
# refresh or two of clock skew between routers' loops.
ABANDONED_SLACK_S = 10.0


class LoraAdapters:
    def __init__(
        self,
        settings: LoraSettings,
        pool: WorkerPool,
        base_name: str,
        store: LoraIntentStore,
        refresh_interval_s: float,
    ) -> None:
        """``store``: the registry every router of the pool shares the intents through;
        ``refresh_interval_s``: how often each of them reads them (``router.
        refresh_interval_s``, the same on every router)."""
        self.settings = settings
        self.pool = pool
        self.base_name = base_name  # the base model's served name: no adapter takes it
        self.store = store
        self.refresh_interval_s = refresh_interval_s
        # The shared intents as last read: at each refresh, and by each load and unload
        # here (with what it wrote), all under the lock.
        self.intents: dict[str, LoraIntent] = {}
        self._inflight: Counter[str] = Counter()  # sequences of each adapter, admitted here
        # The seq of each RETIRING intent this router wrote and is unloading now: never
        # taken for abandoned here.
        self._unloading: set[int] = set()
        # (name, seq) of each RETIRING intent -> when this router first read it (monotonic).
        self._retiring_since: dict[tuple[str, int], float] = {}
        self._reconciler = LoraReconciler(pool)
        self._outage = OutageLog(logger, "LoRA intents unreachable in the registry, "
                                 "reconciling toward the last read")  # fmt: skip
        self._lock = asyncio.Lock()  # one load, unload or reconcile at a time
        self._task: asyncio.Task | None = None

    @property
    def abandoned_after_s(self) -> float:
        """How long an unload may stay RETIRING before any router finishes it: past its
        router's longest wait (``_drain``)."""
        waited_s = max(self.settings.unload_grace_s, 2 * self.refresh_interval_s)
        return waited_s + 2 * self.refresh_interval_s + ABANDONED_SLACK_S

    # ------------------------------------------------------------------ requests

    def withdrawn(self, name: str) -> bool:
        """Whether ``name`` is being unloaded or was unloaded, through any router (one in
        ``lora.adapters`` never is: the config decides)."""
        intent = self.intents.get(name)
        return intent is not None and not intent.loaded and name not in self.settings.adapters

    def names(self) -> list[str]:
        """Every adapter a client may name: configured, loaded through any router, or
        served by a worker (and not withdrawn)."""
        names = set(self.settings.adapters)
        names.update(name for name, intent in self.intents.items() if intent.loaded)
        for worker in self.pool.workers.values():
            if worker.available:
                names.update(worker.lora_adapters)
        return sorted(name for name in names if not self.withdrawn(name))

    def path_of(self, name: str) -> str | None:
        """The directory the workers read ``name`` from, if configured or loaded through
        a router (one a worker alone serves is not known here)."""
        intent = self.intents.get(name)
        loaded = intent.path if intent is not None and intent.loaded else None
        return self.settings.adapters.get(name, loaded)

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
        the one loaded through the routers, then the smallest. 503 if no worker serves it
        now; 404 if it is withdrawn."""
        if self.withdrawn(name):
            raise model_not_found(name)
        counts = Counter(
            worker.lora_adapters[name]
            for worker in self.pool.workers.values()
            if worker.available and name in worker.lora_adapters
        )
        if not counts:
            raise unavailable(f"no worker serves LoRA adapter {name!r} right now")
        intent = self.intents.get(name)
        mine = intent.fingerprint if intent is not None and intent.loaded else None
        fingerprint = max(sorted(counts), key=lambda fp: (counts[fp], fp == mine))
        return LoraRef(name, fingerprint)

    # ------------------------------------------------------------------ load

    async def load(self, name: str, path: str) -> dict[str, Any]:
        """Load ``path`` as ``name`` on every available worker; the reply body of the
        endpoint. Raises ``APIError``: 400 for a bad name or adapter, or one being
        unloaded (nothing stays loaded), 503 when a worker or the registry could not be
        reached."""
        self._check_load(name, path)
        if self._retiring(name):
            raise _being_unloaded(name)
        async with self._lock:
            await self._read_intents_or_503()
            # Again, under the lock: an unload queued before this load on a held lock
            # took it first, and this load, answered 200, was then undone on every
            # worker, leaving the name both loaded and unloaded.
            if self._retiring(name):
                raise _being_unloaded(name)
            workers = [w for w in self.pool.workers.values() if w.available]
            if not workers:
                raise unavailable("no worker is available to load the adapter on")
            replies, fingerprint = await self._load_on_all(workers, name, path)
            await self._record_load(LoraIntent(name=name, path=path, fingerprint=fingerprint,
                                               state=LoraIntentState.LOADED), replies)  # fmt: skip
        logger.info("LoRA adapter %s loaded from %s on %d workers (%s)",
                    name, path, len(replies), fingerprint)  # fmt: skip
        return {"object": "lora_adapter", "id": name, "fingerprint": fingerprint,
                "num_workers": len(replies)}  # fmt: skip

    def _check_load(self, name: str, path: str) -> None:
        self._check_enabled()
        if not valid_lora_name(name):
            raise bad_request(f"a LoRA adapter name is {LORA_NAME_RULE}", "lora_name")
        if name == self.base_name:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        if not path:
            raise bad_request("needs the adapter's directory (as the workers see it)", "lora_path")

    def _retiring(self, name: str) -> bool:
        intent = self.intents.get(name)
        return intent is not None and intent.state is LoraIntentState.RETIRING

    async def _load_on_all(
        self, workers: list[WorkerState], name: str, path: str
    ) -> tuple[list[tuple[WorkerState, pb.LoadLoraAdapterResponse]], str]:
        """Load on every one of ``workers``: their replies and the one fingerprint they
        all read. All or nothing: on any failure it is undone where it was loaded, and
        the client's ``APIError`` raised."""
        served_before = {w.worker_id for w in workers if name in w.lora_adapters}
        results = await asyncio.gather(*(load_on(worker, name, path) for worker in workers),
                                       return_exceptions=True)  # fmt: skip
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
            await unload_from(added + unsure, name)
            raise _load_error(failures, len(workers), fingerprints)
        (fingerprint,) = fingerprints
        return replies, fingerprint

    async def _record_load(
        self, intent: LoraIntent, replies: list[tuple[WorkerState, pb.LoadLoraAdapterResponse]]
    ) -> None:
        """Write the loaded intent, the load's last step: other routers serve it from then
        on. Unrecorded, the load is undone (no router would keep it on a worker that
        restarts, nor unload it): 503."""
        try:
            await self._write(intent)
        except RegistryError as exc:
            await unload_from([w for w, reply in replies if not reply.already_loaded], intent.name)
            raise unavailable(f"the registry could not record the load ({exc}); nothing was "
                              "loaded") from None  # fmt: skip
        for worker, _ in replies:
            worker.set_lora_adapters({**worker.lora_adapters, intent.name: intent.fingerprint})

    # ------------------------------------------------------------------ unload

    async def unload(self, name: str) -> dict[str, Any]:
        """Unload ``name`` from every worker that answers. Every router's new requests of
        it get 404 from its next refresh (this router's at once); the unload waits until
        they all read that, and until this router's requests of it have finished (at
        most ``lora.unload_grace_s``): one between its prefill and its decode worker
        would be refused there. Requests still running after that finish with it too (a
        worker's requests hold their adapter). 404 if no worker serves it and no router
        loaded it; 503 if a worker that serves it or the registry could not be reached
        (retry: unloading is idempotent, and every router's reconcile keeps trying)."""
        self._check_enabled()
        if name in self.settings.adapters:
            raise bad_request(
                f"LoRA adapter {name!r} is in lora.adapters: every worker loads it at start. "
                "Remove it from the config instead",
                "lora_name",
            )
        retiring = await self._retire(name)
        self._unloading.add(retiring.seq)
        try:
            await self._drain(name)
            async with self._lock:
                workers = [w for w in self.pool.workers.values() if w.healthy]
                failed = await unload_from(workers, name)
                await self._record_unload(retiring)
        finally:
            self._unloading.discard(retiring.seq)
        if failed:
            raise unavailable(
                f"LoRA adapter {name!r} could not be unloaded from {len(failed)} of "
                f"{len(workers)} workers ({', '.join(failed)}); it is no longer placed "
                "there, and the routers retry"
            )
        logger.info("LoRA adapter %s unloaded from %d workers", name, len(workers))
        return {"object": "lora_adapter", "id": name, "deleted": True}

    async def _retire(self, name: str) -> LoraIntent:
        """Write ``name``'s RETIRING intent (404 if there is nothing to unload)."""
        async with self._lock:
            await self._read_intents_or_503()
            intent = self.intents.get(name)
            held = any(name in w.lora_adapters for w in self.pool.workers.values())
            if not held and (intent is None or intent.state is LoraIntentState.UNLOADED):
                raise APIError(404, f"LoRA adapter {name!r} is not loaded", param="lora_name",
                               code="model_not_found")  # fmt: skip
            retiring = LoraIntent(name=name, path=intent.path if intent else "",
                                  fingerprint=intent.fingerprint if intent else "",
                                  state=LoraIntentState.RETIRING)  # fmt: skip
            try:
                return await self._write(retiring)
            except RegistryError as exc:
                raise unavailable(f"the registry could not record the unload ({exc}); "
                                  "nothing was unloaded") from None  # fmt: skip

    async def _drain(self, name: str) -> None:
        """Wait until every router has read the RETIRING intent (two refresh intervals:
        each reads at every refresh) and this router's requests of ``name`` have ended,
        or ``lora.unload_grace_s`` has passed."""
        start = time.monotonic()
        seen_at = start + 2 * self.refresh_interval_s
        deadline = max(seen_at, start + self.settings.unload_grace_s)
        while (now := time.monotonic()) < deadline and (now < seen_at or self._inflight[name]):
            await asyncio.sleep(0.05)
        if self._inflight[name]:
            logger.warning("unloading LoRA adapter %s with %d sequences still in flight",
                           name, self._inflight[name])  # fmt: skip

    async def _record_unload(self, retiring: LoraIntent) -> None:
        """Write the UNLOADED tombstone over this unload's RETIRING intent, unless another
        router wrote the name since (loaded it again after taking this unload for
        abandoned, say): the later intent stands, and the reconcile brings the workers
        to it."""
        unloaded = msgspec.structs.replace(retiring, state=LoraIntentState.UNLOADED)
        try:
            written = await self._write(unloaded, if_seq=retiring.seq)
        except RegistryError as exc:  # left RETIRING: a retry, or any router, finishes it
            raise unavailable(f"LoRA adapter {retiring.name!r} was unloaded from the workers, "
                              f"but the registry could not record it ({exc}): retry the "
                              "unload") from None  # fmt: skip
        if written is None:
            logger.info("LoRA adapter %s was written through another router during its "
                        "unload here; that stands", retiring.name)  # fmt: skip

    def _check_enabled(self) -> None:
        if not self.settings.runtime_loading:
            raise APIError(
                404,
                "loading LoRA adapters at runtime is off: set lora.runtime_loading",
                code="not_found",
            )

    # ------------------------------------------------------------------ shared intents

    async def _read_intents(self) -> None:
        """Read the shared intents (under the lock). Raises ``RegistryError``."""
        self.intents = await asyncio.to_thread(self.store.lora_intents)

    async def _read_intents_or_503(self) -> None:
        try:
            await self._read_intents()
        except RegistryError as exc:
            raise unavailable(f"the registry cannot be read: {exc}") from None

    async def _write(self, intent: LoraIntent, if_seq: int | None = None) -> LoraIntent | None:
        """Write ``intent`` (under the lock; ``LoraIntentStore.set_lora_intent``) and keep
        it as read. Raises ``RegistryError``."""
        written = await asyncio.to_thread(self.store.set_lora_intent, intent, if_seq)
        if written is not None:
            self.intents[written.name] = written
        return written

    # ------------------------------------------------------------------ reconcile

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.reconcile()
            except Exception:
                logger.exception("LoRA adapter reconcile failed")

    async def reconcile(self) -> None:
        """Read the shared intents and bring every available worker to them (toward the
        last read while the registry is unreachable); finish abandoned unloads."""
        async with self._lock:
            try:
                await self._read_intents()
                await self._finish_abandoned_unloads()
            except RegistryError as exc:
                self._outage.failed(exc)
            else:
                self._outage.succeeded()
            await self._reconciler.run(self.intents, self.settings.adapters)

    async def _finish_abandoned_unloads(self) -> None:
        """Unload each adapter left RETIRING past ``abandoned_after_s`` (its router
        stopped, or lost the registry, midway), and write its tombstone: no router
        serves it or loads it again meanwhile, so nothing else would end that. Raises
        ``RegistryError``."""
        now = time.monotonic()
        retiring = {(intent.name, intent.seq): intent for intent in self.intents.values()
                    if intent.state is LoraIntentState.RETIRING
                    and intent.seq not in self._unloading}  # fmt: skip
        self._retiring_since = {key: self._retiring_since.get(key, now) for key in retiring}
        for key, intent in retiring.items():
            if now - self._retiring_since[key] < self.abandoned_after_s:
                continue
            logger.warning("LoRA adapter %s has been left being unloaded for %.0f s (its "
                           "router stopped?): unloading it here", intent.name,
                           now - self._retiring_since[key])  # fmt: skip
            await unload_from([w for w in self.pool.workers.values() if w.healthy], intent.name)
            unloaded = msgspec.structs.replace(intent, state=LoraIntentState.UNLOADED)
            await self._write(unloaded, if_seq=intent.seq)


def _being_unloaded(name: str) -> APIError:
    return bad_request(f"LoRA adapter {name!r} is being unloaded: retry after", "lora_name")


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
            f"({worker.worker_id}: {detail(exc)}); nothing was loaded"
        )
    return bad_request(
        f"the workers read different files at lora_path (fingerprints "
        f"{', '.join(sorted(fingerprints))}): give a path every worker sees alike",
        "lora_path",
    )


def _refused(exc: BaseException) -> TypeGuard[grpc.aio.AioRpcError]:
    """Whether a worker's load failed by refusing (a bad adapter, a taken name, the
    limit): nothing was loaded there."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
