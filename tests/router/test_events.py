"""The router's event listener over real ZMQ sockets: every worker's events reach the index,
a worker whose replay socket freezes holds back only its own, and a removed or replaced
worker's late events never come back into the index."""

from __future__ import annotations

import dataclasses
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from common.config import Role
from common.event_bus import TOPIC, KVEventPublisher
from common.kv_events import BlockStored, KVEventBatch, encode_batch
from common.registry import WorkerInfo
from router.events import EventListener
from router.prefix_index import PrefixIndex
from tests.common.test_event_bus import free_ports
from tests.support.polling import eventually

_END = struct.pack(">q", -1)


def info(worker_id: str, pub_port: int, replay_port: int) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=Role.DECODE, grpc_address="127.0.0.1:1",
        events_endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )  # fmt: skip


def stored(tag: int) -> BlockStored:
    return BlockStored([bytes([tag]) * 32], None, list(range(16)), 16)


def wait_for(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``condition`` held (checked every 5 ms); fails past ``timeout_s``."""
    start = time.monotonic()
    assert eventually(condition, timeout_s, interval_s=0.005), "condition never held"
    return time.monotonic() - start


class Worker:
    """A real publisher with heartbeats on a thread, as a worker's engine loop sends them."""

    def __init__(self, worker_id: str, buffer_size: int = 4096) -> None:
        pub_port, replay_port = free_ports(2)
        self.publisher = KVEventPublisher("127.0.0.1", pub_port, replay_port, buffer_size)
        self.info = info(worker_id, pub_port, replay_port)
        self._lock = threading.Lock()  # publish and heartbeat come from one thread in a worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat)
        self._thread.start()

    def publish(self, tag: int) -> None:
        with self._lock:
            self.publisher.publish([stored(tag)])

    def _beat(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                self.publisher.heartbeat()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.publisher.close()


class FrozenWorker:
    """A worker whose replay socket takes requests and answers only when told to."""

    def __init__(self, worker_id: str) -> None:
        pub_port, replay_port = free_ports(2)
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.info = info(worker_id, pub_port, replay_port)

    def await_replay_request(self, timeout_s: float = 10.0) -> bytes:
        """Announce batch 0 by heartbeat until the subscriber asks for it; its identity."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pub.send_multipart([TOPIC, struct.pack(">q", 0), b""])
            if self.replay.poll(20):
                identity, _start = self.replay.recv_multipart()
                return identity
        raise AssertionError("the listener never asked for a replay")

    def answer(self, identity: bytes, tag: int) -> None:
        batch = KVEventBatch(seq=0, ts=time.time(), events=[stored(tag)])
        self.replay.send_multipart([identity, struct.pack(">q", 0), encode_batch(batch)])
        self.replay.send_multipart([identity, _END, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)


@pytest.fixture
def listener() -> Iterator[EventListener]:
    listener = EventListener(PrefixIndex(), threading.Lock())
    listener.start()
    yield listener
    listener.stop()
    # Nothing leaked: every feed thread ended.
    assert listener.num_threads == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-events-")]


def num_blocks(listener: EventListener, worker_id: str) -> int:
    with listener.lock:
        return listener.index.num_blocks(worker_id)


def test_every_workers_events_reach_the_index(listener: EventListener):
    workers = [Worker(f"decode-{i}") for i in range(3)]
    try:
        for worker in workers:
            listener.add(worker.info)
        for i, worker in enumerate(workers):
            for tag in range(i + 1):
                worker.publish(10 * i + tag)
        for i, worker in enumerate(workers):
            wait_for(lambda: num_blocks(listener, worker.info.worker_id) == i + 1, 10)  # noqa: B023
        assert listener.num_threads == 3
        assert 3 <= listener.num_batches <= 6  # (joining: a snapshot may hold a few)
        assert listener.num_resyncs == 0
    finally:
        for worker in workers:
            worker.close()


def test_a_frozen_replay_holds_back_only_its_own_worker(listener: EventListener):
    """A worker that froze between announcing a batch and answering the replay for it: the
    other worker's new events still reach the index at once, not after the replay's 2 s
    timeout (which is how long one shared listener thread was held)."""
    healthy, frozen = Worker("decode-healthy"), FrozenWorker("decode-frozen")
    try:
        listener.add(healthy.info)
        healthy.publish(1)
        wait_for(lambda: num_blocks(listener, "decode-healthy") == 1, 10)
        listener.add(frozen.info)
        frozen.await_replay_request()  # its feed now waits on the replay
        healthy.publish(2)
        took_s = wait_for(lambda: num_blocks(listener, "decode-healthy") == 2, 10)
        assert took_s < 1.0
        assert num_blocks(listener, "decode-frozen") == 0
    finally:
        healthy.close()
        frozen.close()


def test_remove_and_replace_forget_a_workers_blocks_at_once(listener: EventListener):
    """Not at the feed's next poll: placement must not read a gone cache meanwhile."""
    worker = Worker("decode-0")
    try:
        listener.add(worker.info)
        worker.publish(1)
        wait_for(lambda: num_blocks(listener, "decode-0") == 1, 10)
        listener.add(worker.info)  # replaced (a restart): what it held is gone
        assert num_blocks(listener, "decode-0") == 0
        worker.publish(2)
        wait_for(lambda: num_blocks(listener, "decode-0") >= 1, 10)
        # The replaced worker's bit is swept off its blocks by a feed's thread.
        wait_for(lambda: not listener.index.sweeping, 10)
        listener.remove("decode-0")
        assert num_blocks(listener, "decode-0") == 0
    finally:
        worker.close()


def test_a_removed_workers_late_replay_is_dropped(listener: EventListener):
    frozen = FrozenWorker("decode-0")
    try:
        listener.add(frozen.info)
        identity = frozen.await_replay_request()
        listener.remove("decode-0")
        frozen.answer(identity, tag=7)  # the replay lands after the worker left
        wait_for(lambda: listener.num_threads == 0, 5)
        assert num_blocks(listener, "decode-0") == 0
        assert listener.num_batches == 0
    finally:
        frozen.close()


def test_a_restarted_worker_keeps_only_its_new_events(listener: EventListener):
    """Re-added under the same id (a restart): the old feed's late replay is dropped, the
    new feed's events are kept, and the old feed's thread ends."""
    old, new = FrozenWorker("decode-0"), Worker("decode-0")
    try:
        listener.add(old.info)
        identity = old.await_replay_request()
        listener.add(new.info)
        new.publish(1)
        wait_for(lambda: num_blocks(listener, "decode-0") == 1, 10)
        old.answer(identity, tag=99)
        wait_for(lambda: listener.num_threads == 1, 5)
        assert num_blocks(listener, "decode-0") == 1
        with listener.lock:
            match = listener.index.match([bytes([99]) * 32], ["decode-0"])
        assert match["decode-0"].num_blocks == 0
    finally:
        old.close()
        new.close()


def test_feeds_added_before_start_begin_at_start():
    listener = EventListener(PrefixIndex(), threading.Lock())
    worker = Worker("decode-0")
    try:
        listener.add(worker.info)
        worker.publish(1)
        time.sleep(0.2)
        assert listener.num_threads == 0
        assert num_blocks(listener, "decode-0") == 0
        listener.start()
        wait_for(lambda: num_blocks(listener, "decode-0") == 1, 10)
    finally:
        listener.stop()
        worker.close()
    assert listener.num_threads == 0


def test_a_worker_with_a_malformed_endpoint_is_skipped(listener: EventListener):
    broken = dataclasses.replace(
        info("decode-broken", 1, 2), events_endpoint="tcp://127.0.0.1:not-a-port"
    )
    healthy = Worker("decode-healthy")
    try:
        listener.add(broken)
        listener.add(healthy.info)
        healthy.publish(1)
        wait_for(lambda: num_blocks(listener, "decode-healthy") == 1, 10)
        wait_for(lambda: listener.num_threads == 1, 5)  # the broken feed ended
    finally:
        healthy.close()


def test_a_router_that_joins_late_learns_the_prefixes_stored_long_ago(listener):
    """A hot prefix is stored once and then only hit, which publishes nothing; 40 other
    batches later a router joins (a restart, a scale-out). From the replay buffer (16
    batches) it learned only the last 16 and routed without the hot prefix for good;
    from a snapshot it knows every block the worker caches."""
    worker = Worker("decode-0", buffer_size=16)
    try:
        worker.publish(200)  # the hot prefix's block
        for tag in range(40):
            worker.publish(tag)
        listener.add(worker.info)
        wait_for(lambda: num_blocks(listener, "decode-0") == 41, 10)
        with listener.lock:
            hit = listener.index.match([bytes([200]) * 32], ["decode-0"], optimistic=False)
        assert hit["decode-0"].gpu_blocks == 1
    finally:
        worker.close()
