"""KV events over real ZMQ sockets: order, gap replay, resync when history is gone."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import msgspec
import zmq

from common import event_bus
from common.event_bus import TOPIC, KVEventPublisher, KVEventSubscriber
from common.hosts import host_port
from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Medium,
    StateRemoved,
    StateStored,
    decode_batch,
    encode_batch,
)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family) for _ in range(n)]
    for s in sockets:
        s.bind((host, 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def connected_pair(buffer_size: int = 4096, host: str = "127.0.0.1"):
    pub_port, replay_port = free_ports(2, host)
    publisher = KVEventPublisher(host, pub_port, replay_port, buffer_size)
    endpoints = (f"tcp://{host_port(host, port)}" for port in (pub_port, replay_port))
    subscriber = KVEventSubscriber(*endpoints)
    # Slow joiner: publish until the subscriber sees something.
    deadline = time.monotonic() + 5
    seen: list = []
    while not seen and time.monotonic() < deadline:
        publisher.publish([BlockRemoved([b"\0" * 32])])
        seen, _ = subscriber.poll(20)
    assert seen, "subscriber never connected"
    return publisher, subscriber


def serve_while_polling(publisher, subscriber, timeout_s=5.0, until=None):
    """Poll the subscriber while the publisher sends heartbeats (on another thread, as a
    worker's engine loop and a router run in two processes)."""
    import threading

    stop = threading.Event()

    def serve():
        last_beat = 0.0
        while not stop.is_set():
            if time.monotonic() - last_beat > 0.2:
                publisher.heartbeat()
                last_beat = time.monotonic()
            time.sleep(0.001)

    thread = threading.Thread(target=serve)
    thread.start()
    batches, resync = [], False
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got, flag = subscriber.poll(50)
            batches += got
            resync |= flag
            if until is not None and until(batches):
                break
    finally:
        stop.set()
        thread.join()
    return batches, resync


def test_events_arrive_in_order_and_late_joiners_catch_up():
    publisher, subscriber = connected_pair()
    first_seq = subscriber.state.next_seq
    for i in range(5):
        publisher.publish([BlockStored([bytes([i]) * 32], None, list(range(16)), 16)])
    batches, resync = serve_while_polling(publisher, subscriber, until=lambda b: len(b) == 5)
    assert not resync
    assert [b.seq for b in batches] == list(range(first_seq, first_seq + 5))
    assert batches[2].events[0].block_hashes == [bytes([2]) * 32]
    publisher.close()
    subscriber.close()


def test_a_worker_on_an_ipv6_address_publishes_and_replays():
    """An IPv6 worker host (ZMQ's sockets took IPv4 alone: "No such device"): events
    arrive, and a gap is replayed from the replay socket."""
    publisher, subscriber = connected_pair(host="::1")
    start = subscriber.state.next_seq
    publisher.publish([BlockRemoved([b"\1" * 32])])
    publish_unseen(publisher, subscriber, 3)
    publisher.publish([BlockRemoved([b"\2" * 32])])
    batches, resync = serve_while_polling(publisher, subscriber, until=lambda b: len(b) == 5)
    assert not resync
    assert [b.seq for b in batches] == list(range(start, start + 5))
    assert subscriber.state.gaps == 1 and subscriber.state.replayed >= 3
    publisher.close()
    subscriber.close()


def test_a_peer_sending_long_subscriptions_is_cut_off_and_others_still_served():
    """libzmq kept every subscription a peer sent, at ~50x its size, with no bound: one
    peer's 190 MiB of them grew a worker by 9 GB. Now a subscription past 64 bytes
    disconnects its sender (whose "kv" subscription, on the same socket, then never
    takes), and a real subscriber is served."""
    publisher, subscriber = connected_pair()
    pub_port = int(subscriber._pub_endpoint.rsplit(":", 1)[1])
    flood = zmq.Context.instance().socket(zmq.SUB)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SUBSCRIBE, b"kv")
    for i in range(20):
        flood.setsockopt(zmq.SUBSCRIBE, b"x" * 100_000 + bytes([i]))
    flood.connect(f"tcp://127.0.0.1:{pub_port}")
    try:
        got_flood = False
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            publisher.publish([BlockRemoved([b"\3" * 32])])
            got_flood |= bool(flood.poll(20))
        batches, _ = serve_while_polling(publisher, subscriber, until=lambda b: len(b) > 3)
        assert len(batches) > 3
        assert not got_flood
    finally:
        flood.close(0)
        publisher.close()
        subscriber.close()


def publish_unseen(publisher, subscriber, count: int) -> None:
    """Publish ``count`` batches the subscriber does not receive (it unsubscribes)."""
    subscriber.socket.setsockopt(zmq.UNSUBSCRIBE, b"kv")
    time.sleep(0.3)  # let the unsubscription reach the publisher
    for i in range(count):
        publisher.publish([BlockRemoved([i.to_bytes(32, "big")])])
    subscriber.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)


def test_gaps_are_replayed():
    publisher, subscriber = connected_pair()
    start = subscriber.state.next_seq
    publish_unseen(publisher, subscriber, 50)
    publisher.publish([BlockRemoved([b"\1" * 32])])
    last = publisher.next_seq - 1
    batches, resync = serve_while_polling(
        publisher, subscriber, until=lambda b: b and b[-1].seq == last
    )
    assert not resync
    assert [b.seq for b in batches] == list(range(start, last + 1))
    # 51 when a heartbeat naming the last batch arrives before the batch itself
    assert subscriber.state.gaps == 1 and subscriber.state.replayed in (50, 51)
    publisher.close()
    subscriber.close()


def test_lost_tail_is_noticed_by_heartbeat():
    publisher, subscriber = connected_pair()
    start = subscriber.state.next_seq
    publish_unseen(publisher, subscriber, 5)
    last = publisher.next_seq - 1
    batches, resync = serve_while_polling(
        publisher, subscriber, until=lambda b: subscriber.state.next_seq == last + 1
    )
    assert not resync and [b.seq for b in batches] == list(range(start, last + 1))
    publisher.close()
    subscriber.close()


def test_lost_history_asks_for_a_resync():
    publisher, subscriber = connected_pair(buffer_size=8)
    publish_unseen(publisher, subscriber, 50)
    publisher.publish([BlockRemoved([b"\1" * 32])])
    last = publisher.next_seq - 1
    batches, resync = serve_while_polling(
        publisher, subscriber, until=lambda b: subscriber.state.next_seq == last + 1
    )
    assert resync and subscriber.state.resyncs == 1
    assert batches[-1].seq == last
    publisher.close()
    subscriber.close()


def test_a_late_joiner_gets_the_whole_cache_as_one_snapshot():
    """4000 batches stored 260,000 blocks and removed some (and state snapshots came and
    went): a subscriber that joins gets one batch, numbered as the last, that clears and
    stores exactly what is cached now (a replay gave only what the buffer still held:
    blocks stored before it, the hot prefixes among them, were never learned)."""
    pub_port, replay_port = free_ports(2)
    publisher = KVEventPublisher("127.0.0.1", pub_port, replay_port, buffer_size=100)
    for i in range(4000):
        hashes = [(i * 65 + j).to_bytes(32, "big") for j in range(65)]
        publisher.publish([BlockStored(hashes, None, list(range(1040)), 16)])
    gone = [(j).to_bytes(32, "big") for j in range(65)]  # batch 0's: long out of the buffer
    publisher.publish([BlockRemoved(gone), BlockStored(gone[:1], None, [1], 16, Medium.CPU)])
    # A hybrid model's state snapshots: after two blocks, one of them gone since.
    followed = [(65 * 7 + 64).to_bytes(32, "big"), (65 * 9 + 64).to_bytes(32, "big")]
    publisher.publish([StateStored(followed), StateRemoved(followed[:1])])
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    batches, _ = serve_while_polling(publisher, subscriber, timeout_s=30,
                                          until=lambda b: len(b) >= 1)  # fmt: skip
    (snapshot,) = batches
    assert snapshot.seq == 4001 and subscriber.state.next_seq == 4002
    cleared, *stored = snapshot.events
    assert isinstance(cleared, AllBlocksCleared)
    by_medium = {event.medium: set(event.block_hashes) for event in stored}
    expected = {(i * 65 + j).to_bytes(32, "big") for i in range(4000) for j in range(65)}
    assert by_medium == {Medium.GPU: expected - set(gone), Medium.CPU: set(gone[:1])}
    assert snapshot.states == [StateStored(followed[1:])]
    publisher.close()
    subscriber.close()


def test_a_long_gap_is_replayed_whole():
    """4000 batches of ~4.5 KB replayed in one burst: past ZMQ's default high-water mark
    the replay socket dropped the rest silently, and the holes kept removed blocks known."""
    publisher, subscriber = connected_pair()
    start = subscriber.state.next_seq
    subscriber.socket.setsockopt(zmq.UNSUBSCRIBE, b"kv")
    time.sleep(0.3)
    for i in range(4000):
        hashes = [(i * 65 + j).to_bytes(32, "big") for j in range(65)]
        publisher.publish([BlockStored(hashes, None, list(range(1040)), 16)])
    subscriber.socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)
    last = publisher.next_seq - 1
    batches, resync = serve_while_polling(publisher, subscriber, timeout_s=30,
                                          until=lambda b: b and b[-1].seq == last)  # fmt: skip
    assert not resync and [b.seq for b in batches] == list(range(start, last + 1))
    publisher.close()
    subscriber.close()


def test_a_replay_with_a_hole_resynchronises_from_a_snapshot(monkeypatch):
    """A batch missing from the middle of a replay (here: gone from the buffer) may have
    removed blocks: the subscriber resynchronises from a snapshot of the cache. (A fresh
    one: the join's, moments ago, would serve within the second, and its batches since
    hold the same hole; in a worker a hole means the buffer overflowed, not within a
    second of a snapshot.)"""
    monkeypatch.setattr(event_bus, "_SNAPSHOT_REUSE_S", 0.0)
    publisher, subscriber = connected_pair()
    publish_unseen(publisher, subscriber, 10)
    hole = publisher.next_seq - 6
    publisher._buffer.remove(next(item for item in publisher._buffer if item[0] == hole))
    publisher.publish([BlockRemoved([b"\1" * 32])])
    last = publisher.next_seq - 1
    batches, resync = serve_while_polling(
        publisher, subscriber, until=lambda b: subscriber.state.next_seq == last + 1
    )
    assert resync and [b.seq for b in batches] == [last] and subscriber.state.snapshots == 2
    assert isinstance(batches[0].events[0], AllBlocksCleared)  # (the join's was the first)
    publisher.close()
    subscriber.close()


class PreSnapshotPublisher:
    """A publisher from before snapshots, on raw sockets: it reads a snapshot request as
    a replay from its start (an 8-byte number, -2), as one did."""

    def __init__(self, batches: list[list]) -> None:
        self.pub_port, self.replay_port = free_ports(2)
        context = zmq.Context.instance()
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.replay = context.socket(zmq.ROUTER)
        self.replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.payloads = [encode_batch(KVEventBatch(seq, 0.0, events))
                         for seq, events in enumerate(batches)]  # fmt: skip

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.pub.send_multipart([b"kv", (len(self.payloads) - 1).to_bytes(8, "big"), b""])
            while self.replay.poll(50):
                identity, request = self.replay.recv_multipart()
                start = int.from_bytes(request, "big", signed=True)
                for seq, payload in enumerate(self.payloads):
                    if seq >= start:
                        self.replay.send_multipart([identity, seq.to_bytes(8, "big"), payload])
                self.replay.send_multipart([identity, (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)


def test_a_subscriber_joins_a_publisher_from_before_snapshots_by_replay():
    """A rolling upgrade: a new router, an old worker. The snapshot request is answered
    as a replay from the start; the subscriber reads it to its end and joins as before."""
    old = PreSnapshotPublisher([[BlockRemoved([bytes([i]) * 32])] for i in range(5)])
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{old.pub_port}",
                                   f"tcp://127.0.0.1:{old.replay_port}")  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=old.serve, args=(stop,))
    thread.start()
    try:
        batches: list = []
        deadline = time.monotonic() + 10
        while len(batches) < 5 and time.monotonic() < deadline:
            batches += subscriber.poll(50)[0]
    finally:
        stop.set()
        thread.join()
        old.close()
        subscriber.close()
    assert [b.seq for b in batches] == list(range(5)) and subscriber.state.snapshots == 0


def test_an_unreadable_batch_asks_for_a_resync_and_later_ones_arrive():
    publisher, subscriber = connected_pair()
    seq = publisher.next_seq
    publisher.next_seq += 1  # a newer worker's event type, as this router reads it
    publisher._pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"\x81\xa4what\xa3new"])
    publisher.publish([BlockRemoved([b"\2" * 32])])
    batches, resync = serve_while_polling(
        publisher, subscriber, until=lambda b: subscriber.state.next_seq == seq + 2
    )
    assert resync and [b.seq for b in batches] == [seq + 1]
    publisher.close()
    subscriber.close()


def test_a_peer_that_asks_for_replays_and_never_reads_queues_one_replay_at_most():
    """Each replay request queued the whole buffer for that peer without bound: a peer
    sending 60,000 8-byte requests and reading nothing grew a worker by 690 MB. Now one
    replay (the buffer and its end) is queued per peer; the rest are dropped."""
    pub_port, replay_port = free_ports(2)
    publisher = KVEventPublisher("127.0.0.1", pub_port, replay_port, buffer_size=10)
    for i in range(10):  # ~64 KB a batch: the kernel's socket buffers hold only a few
        hashes = [(i * 2000 + j).to_bytes(32, "big") for j in range(2000)]
        publisher.publish([BlockRemoved(hashes)])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        for _ in range(100):
            dealer.send((0).to_bytes(8, "big"))
        time.sleep(1.0)  # the replay thread answers (or drops) every request
        received = 0
        while dealer.poll(500):
            dealer.recv_multipart()
            received += 1
        assert 11 <= received < 100, received  # 1,100 were sent when nothing was dropped
    finally:
        dealer.close(0)
        publisher.close()


def test_one_connection_gets_one_replay_however_often_it_asks():
    """Each 8-byte request replayed the whole buffer (~27 ms of the replay thread at 4096
    batches), so one connection asking in a loop kept it busy; a subscriber asks once
    per connection (a socket per replay), so a connection gets one answer."""
    publisher, subscriber = connected_pair(buffer_size=16)
    for i in range(5):
        publisher.publish([BlockRemoved([bytes([i]) * 32])])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(subscriber._replay_endpoint)
    try:
        for _ in range(3):
            dealer.send((0).to_bytes(8, "big"))
        ends = 0
        while dealer.poll(1000):
            ends += dealer.recv_multipart()[0] == struct.pack(">q", -1)
        assert ends == 1
    finally:
        dealer.close(0)
        publisher.close()
        subscriber.close()


def test_a_publisher_that_started_over_on_the_same_ports_is_joined_again():
    """A worker restarted on its ports numbers its batches from 0 again: they read as
    seen already, and the old engine's blocks stayed known until the router's next probe
    noticed the new engine id. A heartbeat behind what was seen tells: resync, then the
    new publisher's batches arrive."""
    pub_port, replay_port = free_ports(2)
    old = KVEventPublisher("127.0.0.1", pub_port, replay_port)
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    deadline = time.monotonic() + 5
    while subscriber.state.next_seq is None or subscriber.state.next_seq < 20:
        assert time.monotonic() < deadline, "the subscriber never connected"
        old.publish([BlockStored([bytes(32)], None, [1], 16)])
        subscriber.poll(10)
    old.close()
    new = None
    while new is None:  # ZMQ lets go of the old sockets' ports in the background
        try:
            new = KVEventPublisher("127.0.0.1", pub_port, replay_port)
        except zmq.ZMQError:
            assert time.monotonic() < deadline + 5, "the ports never came free"
            time.sleep(0.05)
    fresh = (7).to_bytes(32, "big")
    batches, resync = [], False
    deadline = time.monotonic() + 20
    while not any(fresh in getattr(e, "block_hashes", ()) for b in batches for e in b.events):
        assert time.monotonic() < deadline, (subscriber.state, batches)
        new.heartbeat()
        if not new.next_seq:  # after the subscriber reconnected, so as not to be missed
            time.sleep(0.3)
            new.publish([BlockStored([fresh], None, [2], 16)])
        got, flag = subscriber.poll(50)
        batches += got
        resync |= flag
    assert resync and subscriber.state.resyncs == 1
    new.close()
    subscriber.close()


def test_a_restart_is_noticed_when_the_new_numbers_first_seen_are_past_the_old():
    """The restarted publisher's first batches were missed (the subscriber reconnecting)
    and the first one seen is past the old numbers: by numbers alone, a continuation, and
    the old engine's blocks stayed known. The publisher's epoch in the topic tells."""
    publisher, subscriber = connected_pair()
    old = publisher.next_seq - 1
    assert subscriber.state.received == old  # (connected_pair's last batch was read)
    publisher._topic = b"kv" + bytes(8)  # what a restarted publisher would say: another epoch
    publish_unseen(publisher, subscriber, 3)  # missed
    publisher.publish([BlockStored([b"\7" * 32], None, [1], 16)])  # seen: past the old numbers
    last = publisher.next_seq - 1
    batches, resync = serve_while_polling(
        publisher, subscriber, until=lambda b: subscriber.state.next_seq == last + 1
    )
    assert resync and subscriber.state.resyncs == 1 and subscriber.state.snapshots == 2
    assert isinstance(batches[0].events[0], AllBlocksCleared)
    publisher.close()
    subscriber.close()


def test_a_router_from_before_state_events_reads_the_blocks_of_a_batch_with_them():
    """A hybrid worker's state events, among the block events, were an unknown tag to a
    router from before them: it refused every batch and its snapshot, and forgot every
    block the worker holds. They travel after the block events now, which such a router
    skips. (Its batch type, as it was, decodes today's bytes.)"""

    class OldBatch(msgspec.Struct, frozen=True, array_like=True):
        seq: int
        ts: float
        events: list[AllBlocksCleared | BlockRemoved | BlockStored]

    stored = BlockStored([b"\1" * 32], None, [], 16)
    events = [
        stored,
        StateStored([b"\1" * 32]),
        BlockRemoved([b"\2" * 32]),
        StateRemoved([b"\3" * 32]),
    ]
    payload = encode_batch(KVEventBatch.of(7, 1.0, events))
    old = msgspec.msgpack.decode(payload, type=OldBatch)
    assert (old.seq, old.events) == (7, [stored, BlockRemoved([b"\2" * 32])])
    new = decode_batch(payload)
    assert new.all_events() == [events[0], events[2], events[1], events[3]]
    plain = encode_batch(KVEventBatch.of(8, 1.0, [stored]))  # (no states: as before, + [])
    assert msgspec.msgpack.decode(plain, type=OldBatch).events == [stored]


def test_a_batch_from_the_builds_that_sent_state_events_among_the_blocks_is_read():
    """Between their introduction and ``states``, hybrid workers sent state events among
    the block events: a router of today refused each batch and snapshot of theirs (an
    unknown tag in ``events``) and forgot every block they held. Read, each kind in its
    field."""

    class MixedBatch(msgspec.Struct, frozen=True, array_like=True):
        seq: int
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared | StateStored | StateRemoved]

    stored = BlockStored([b"\1" * 32], None, [], 16)
    state = StateStored([b"\1" * 32])
    payload = msgspec.msgpack.encode(
        MixedBatch(3, 1.0, [stored, state, BlockRemoved([b"\2" * 32])])
    )
    batch = decode_batch(payload)
    assert (batch.seq, batch.events, batch.states) == (
        3,
        [stored, BlockRemoved([b"\2" * 32])],
        [state],
    )


def test_unreadable_batches_are_said_once_a_minute_per_worker(caplog):
    """A newer worker's event type (a rolling upgrade) is unreadable here: a traceback per
    batch filled the router's log as the worker's cache changed (200 batches: 1800
    lines). One line a minute per worker, naming it, with a count."""
    context = zmq.Context.instance()
    pub, replay = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
    pub.bind("tcp://127.0.0.1:0")
    replay.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    subscriber = KVEventSubscriber(endpoint, replay.getsockopt(zmq.LAST_ENDPOINT).decode(),
                                   replay_timeout_s=0.05)  # fmt: skip
    try:
        time.sleep(0.3)  # (the subscription reaches the publisher)
        with caplog.at_level(logging.WARNING, logger="common.event_bus"):
            for seq in range(20):
                pub.send_multipart([TOPIC, struct.pack(">q", seq), b"\x99not a batch"])
                subscriber.poll(50)
                while replay.poll(0):  # (no replay: the test answers nothing)
                    replay.recv_multipart()
        lines = [r for r in caplog.records if r.name == "common.event_bus"]
        assert len(lines) == 1 and endpoint in lines[0].getMessage()
        assert lines[0].exc_info is None
    finally:
        subscriber.close()
        pub.close()
        replay.close()
