"""Feeds the prefix index from every worker's KV events, each worker on a thread of its own.

One SUB socket per worker, owned by that worker's feed thread; batches are applied under the
index lock in sequence order. A subscriber that lost history (the worker's replay buffer no
longer reached back) makes the router forget what it knew of that worker before applying
what came after.

Why a thread per worker, not one poller for all: filling a gap is a blocking round trip to
the worker's replay socket (up to its 2 s timeout). A worker that freezes between showing
a gap and answering would otherwise hold every other worker's events that long, and the
router would place by a stale prefix index. A feed thread costs one mostly idle thread per
worker; routers see tens to hundreds of workers, not thousands.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from common.event_bus import KVEventSubscriber
from common.kv_events import KVEventBatch
from common.registry import WorkerInfo
from router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

# How long a feed waits for events before it checks whether to stop. Events wake it at
# once; this bounds only how soon a removed feed's thread ends (its blocks are forgotten
# at removal), and keeps idle wake-ups to 4 a second per worker.
POLL_MS = 250
STOP_JOIN_S = 5.0  # replays time out after 2 s: a feed ends well within this


class EventListener:
    """Owns one feed per worker. ``add`` and ``remove`` never block on a worker: a removed
    feed's blocks are forgotten at once, and its thread ends on its own at its next poll
    (or when its replay times out), without touching the index again."""

    def __init__(self, index: PrefixIndex, lock: threading.Lock) -> None:
        self.index = index
        self.lock = lock  # guards the index, the counters and every feed's ``stopped``
        self._feeds: dict[str, _Feed] = {}
        self._ending: list[_Feed] = []  # removed or replaced feeds whose thread may still run
        self._started = False
        self.num_batches = 0
        self.num_resyncs = 0

    def start(self) -> None:
        with self.lock:
            self._started = True
            feeds = list(self._feeds.values())
        for feed in feeds:
            feed.start()

    def add(self, worker: WorkerInfo) -> None:
        """Listen to ``worker``, replacing (and forgetting) any earlier feed of its id: a
        restarted worker's cache and event stream are new."""
        feed = _Feed(self, worker)
        with self.lock:
            self._end(worker.worker_id)
            self._feeds[worker.worker_id] = feed
            started = self._started
        if started:
            feed.start()

    def remove(self, worker_id: str) -> None:
        with self.lock:
            self._end(worker_id)

    def stop(self) -> None:
        with self.lock:
            self._started = False
            for worker_id in list(self._feeds):
                self._end(worker_id)
            ending, self._ending = self._ending, []
        for feed in ending:
            feed.join(STOP_JOIN_S)

    @property
    def num_threads(self) -> int:
        """Feed threads still running, ended feeds included (for tests and leak checks)."""
        with self.lock:
            self._ending = [feed for feed in self._ending if feed.is_alive()]
            feeds = [*self._feeds.values(), *self._ending]
        return sum(feed.is_alive() for feed in feeds)

    def sweep(self) -> None:
        """A slice of cleared workers' blocks (``PrefixIndex.sweep``), on a feed's thread:
        the lock is held ~3 ms at a time, not for a whole worker's blocks."""
        if self.index.sweeping:  # (a read without the lock: at worst one poll late)
            with self.lock:
                self.index.sweep()

    def _end(self, worker_id: str) -> None:
        """Under ``lock``: stop the worker's feed, if any, and forget its blocks."""
        feed = self._feeds.pop(worker_id, None)
        if feed is not None:
            feed.stopped = True
            self._ending = [f for f in self._ending if f.is_alive()]
            self._ending.append(feed)
        self.index.clear_worker(worker_id)


class _Feed:
    """One worker's events: its subscriber lives and dies on this feed's thread."""

    def __init__(self, listener: EventListener, worker: WorkerInfo) -> None:
        self.listener = listener
        self.worker = worker
        self.stopped = False  # set under listener.lock; checked under it before each apply
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-{worker.worker_id}", daemon=True
        )

    def start(self) -> None:
        if not self.stopped and self._thread.ident is None:  # start once
            self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        worker_id = self.worker.worker_id
        try:
            subscriber = KVEventSubscriber(self.worker.events_endpoint, self.worker.replay_endpoint)
        except zmq.ZMQError as exc:  # a malformed endpoint: route without its prefix hits
            logger.error("cannot listen to %s's events: %s", worker_id, exc)
            return
        try:
            while not self.stopped:
                try:
                    batches, resync = subscriber.poll(POLL_MS)
                except zmq.ZMQError as exc:
                    logger.warning("events from %s: %s", worker_id, exc)
                    time.sleep(POLL_MS / 1000)
                    continue
                except Exception:
                    # A bug, whatever it is: forget the worker's blocks rather than keep
                    # stale ones, and keep listening.
                    logger.exception("events from %s failed: forgetting its blocks", worker_id)
                    batches, resync = [], True
                if batches or resync:
                    self._apply(batches, resync)
                self.listener.sweep()
        finally:
            subscriber.close()

    def _apply(self, batches: list[KVEventBatch], resync: bool) -> None:
        listener = self.listener
        with listener.lock:
            if self.stopped:  # removed or replaced while this poll ran: its blocks are gone
                return
            worker_id = self.worker.worker_id
            if resync:
                listener.num_resyncs += 1
                listener.index.clear_worker(worker_id)
            for batch in batches:
                listener.index.apply(worker_id, batch.all_events())
            listener.num_batches += len(batches)
