"""Feeds the prefix index from every worker's KV events, on a thread of its own.

One SUB socket per worker; batches are applied under the index lock in sequence order.
A subscriber that lost history (the worker's replay buffer no longer reached back) makes
the router forget what it knew of that worker before applying what came after.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from common.event_bus import KVEventSubscriber
from common.registry import WorkerInfo
from router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


class EventListener:
    def __init__(self, index: PrefixIndex, lock: threading.Lock) -> None:
        self.index = index
        self.lock = lock
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.num_batches = 0
        self.num_resyncs = 0

    def start(self) -> None:
        self._thread.start()

    def add(self, worker: WorkerInfo) -> None:
        self._commands.put(lambda: self._add(worker))

    def remove(self, worker_id: str) -> None:
        self._commands.put(lambda: self._remove(worker_id))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for subscriber in self._subscribers.values():
            subscriber.close()

    def _add(self, worker: WorkerInfo) -> None:
        self._remove(worker.worker_id)
        self._subscribers[worker.worker_id] = KVEventSubscriber(
            worker.events_endpoint, worker.replay_endpoint
        )

    def _remove(self, worker_id: str) -> None:
        subscriber = self._subscribers.pop(worker_id, None)
        if subscriber is not None:
            subscriber.close()
        with self.lock:
            self.index.clear_worker(worker_id)

    def _run(self) -> None:
        poller = zmq.Poller()
        registered: set[str] = set()
        while not self._stop.is_set():
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:  # one bad command must not end the listener
                    logger.exception("event listener command failed")
            if registered != set(self._subscribers):
                poller = zmq.Poller()
                for subscriber in self._subscribers.values():
                    poller.register(subscriber.socket, zmq.POLLIN)
                registered = set(self._subscribers)
            ready = dict(poller.poll(100)) if registered else {}
            if not registered:
                self._stop.wait(0.1)
            for worker_id, subscriber in list(self._subscribers.items()):
                if subscriber.socket not in ready:
                    continue
                try:
                    batches, resync = subscriber.poll(0)
                except zmq.ZMQError as exc:
                    logger.warning("events from %s: %s", worker_id, exc)
                    continue
                except Exception:
                    # A bug, whatever it is: forget the worker's blocks rather than keep
                    # stale ones, and keep listening to everyone.
                    logger.exception("events from %s failed: forgetting its blocks", worker_id)
                    with self.lock:
                        self.num_resyncs += 1
                        self.index.clear_worker(worker_id)
                    continue
                with self.lock:
                    if resync:
                        self.num_resyncs += 1
                        self.index.clear_worker(worker_id)
                    for batch in batches:
                        self.index.apply(worker_id, batch.events)
                self.num_batches += len(batches)
