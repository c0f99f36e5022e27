"""KV events over ZMQ: one publisher per worker, any number of subscribers (routers).

Wire format (msgpack via msgspec, never pickle):

    PUB    [b"kv" + epoch, seq: 8-byte big-endian, KVEventBatch]  one message per batch
    PUB    [b"kv" + epoch, last seq, b""]                          heartbeat (idle: ~1/s)
    replay request  (DEALER → ROUTER)  [start_seq: 8 bytes]
    replay response                    [seq, KVEventBatch] ... then [seq = -1, b""]
    snapshot request                   [-2: 8 bytes]
    snapshot response                  [-2, KVEventBatch]: the whole cache, see below

``epoch`` is 8 random bytes of the publisher's start: a worker restarted on its ports numbers
its batches from 0 again, and a subscriber that saw the new numbers only once they passed
the old ones took them for a continuation (the old engine's blocks stayed known until the
router's probe saw the new engine id). It rides in the topic, which subscribers match by
prefix, so routers from before it read the messages unchanged.

The publisher keeps the last ``buffer_size`` batches. Heartbeats carry the last sequence
number, so a subscriber also notices batches lost at the end of a burst. A subscriber that
sees a gap in the sequence asks the replay socket for everything from the first missing
batch; if the buffer no longer reaches that far it is told so (the first replayed seq is
later than asked) and must resynchronise (forget the worker's blocks and rebuild from new events).

Sockets bind to the configured host only. ``publish`` and ``heartbeat`` are called from
one thread (the engine's); replays are answered by the publisher's own thread, so a long
engine step never delays them (a replay that times out makes the router forget the
worker's blocks, and its listener waits for it).

A subscriber that joins, or must resynchronise, asks for a *snapshot* rather than the
trailing batches: one batch, numbered as the last one published, holding
``AllBlocksCleared`` and then every block the worker caches, per tier (and, for a hybrid
model, every block a state snapshot follows). Workers announce a
block when they store it, never when a request hits it, so the hottest prefixes (the
least evicted) were the ones a router that joined late, or lost history, never learned
again (a router restarted against long-running workers routed without them for good).
The publisher keeps the snapshot as it publishes: the set of each tier's hashes, updated
by its own events (the same bytes objects as the events', so a set entry each). A
publisher that predates snapshots answers the request as a replay from its start, which
the subscriber reads to its end and sets aside; it then joins by a replay, as before.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec
import zmq

from common.hosts import host_port
from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    Medium,
    StateRemoved,
    StateStored,
    decode_batch,
    encode_batch,
)
from common.zmq_tcp import endpoint_host, tcp_socket

logger = logging.getLogger(__name__)

TOPIC = b"kv"
_END = struct.pack(">q", -1)
_SNAPSHOT = struct.pack(">q", -2)
_SNAPSHOT_REUSE_S = 1.0  # one encoded snapshot serves the requests of a second
_ANSWERED_PEERS = 4096  # connections remembered as answered (one reply each)


_UNREADABLE_LOG_S = 60.0  # how often one subscriber says it drops unreadable batches
_MAX_SUBSCRIPTION_BYTES = 64  # a subscription message: 1 byte + the topic (b"kv")


class KVEventPublisher:
    def __init__(self, host: str, pub_port: int, replay_port: int, buffer_size: int = 4096):
        self._ctx = zmq.Context.instance()
        self._pub = tcp_socket(self._ctx, zmq.PUB, host)
        # Subscribers write too: each subscription is a message, and libzmq keeps every
        # one it is sent, at ~50x its size. Ours is 3 bytes; without this bound one peer
        # sending 190 MiB of long subscriptions grew a worker by 9 GB (a security audit,
        # 2026-12-02). A peer whose message is longer is disconnected instead.
        self._pub.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION_BYTES)
        self._topic = TOPIC + os.urandom(8)  # (its epoch: module docstring)
        self._pub.bind(f"tcp://{host_port(host, pub_port)}")
        replay = tcp_socket(self._ctx, zmq.ROUTER, host)  # the replay thread's once it runs
        # A replay is up to buffer_size messages and its end in one burst; past the
        # default high-water mark a ROUTER drops the rest silently, leaving holes. The
        # mark is per peer (each replay is a socket of its own), and not unlimited: a
        # peer that asks again and again and never reads would queue the buffer each
        # time in this process's memory (60,000 requests: +690 MB); its extra replies
        # are dropped instead. A request is 8 bytes.
        replay.setsockopt(zmq.SNDHWM, buffer_size + 1)
        replay.setsockopt(zmq.MAXMSGSIZE, 64)
        try:
            replay.bind(f"tcp://{host_port(host, replay_port)}")
        except zmq.ZMQError:
            replay.close(0)
            self._pub.close(0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        # The buffer and the cached blocks: updated by publish, read by replays.
        self._lock = threading.Lock()
        self._cached: dict[Medium, set[bytes]] = {medium: set() for medium in Medium}
        self._states: set[bytes] = set()  # blocks a state snapshot follows (hybrid models)
        self._block_size = 0  # (BlockStored carries it; the router reads none of it)
        # Snapshots are one message of the whole cache (3 MiB at 100,000 blocks), so the
        # per-peer high-water mark, which counts messages, does not bound them: a peer
        # asking again and again without reading queued thousands (150: +490 MB). Each
        # connection gets one (a subscriber asks once per connection), and one encoded
        # snapshot serves every request for a second (queued replies share its buffer).
        self._snapshot_cache: tuple[float, bytes] | None = None  # (made at, payload)
        self._answered_peers: OrderedDict[bytes, None] = OrderedDict()
        self.next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve_replays, args=(replay,), name="kv-event-replay", daemon=True
        )
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        seq = self.next_seq
        payload = encode_batch(KVEventBatch.of(seq, time.time(), events))
        with self._lock:  # the snapshot and the sequence number move together
            self._keep(events)
            self._buffer.append((seq, payload))
            self.next_seq += 1
        self._pub.send_multipart([self._topic, struct.pack(">q", seq), payload], copy=False)

    def _keep(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._cached[event.medium].update(event.block_hashes)
                self._block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                self._cached[event.medium].difference_update(event.block_hashes)
            elif isinstance(event, StateStored):
                self._states.update(event.block_hashes)
            elif isinstance(event, StateRemoved):
                self._states.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for cached in self._cached.values():
                    cached.clear()
                self._states.clear()

    def _snapshot(self) -> bytes:
        """The encoded snapshot: the last one if made within ``_SNAPSHOT_REUSE_S`` (a
        subscriber catches up on what followed from the buffer)."""
        now = time.monotonic()
        cache = self._snapshot_cache
        if cache is not None and now - cache[0] < _SNAPSHOT_REUSE_S:
            return cache[1]
        with self._lock:
            seq = self.next_seq - 1
            cached = {medium: list(hashes) for medium, hashes in self._cached.items()}
            states = list(self._states)
        events: list[KVEvent] = [AllBlocksCleared()]
        events += [BlockStored(hashes, None, [], self._block_size, medium)
                   for medium, hashes in cached.items() if hashes]  # fmt: skip
        if states:
            events.append(StateStored(states))
        payload = encode_batch(KVEventBatch.of(seq, time.time(), events))
        self._snapshot_cache = (now, payload)
        return payload

    def heartbeat(self) -> None:
        """Tell subscribers the last sequence number (call about once a second)."""
        self._pub.send_multipart([self._topic, struct.pack(">q", self.next_seq - 1), b""])

    def _serve_replays(self, replay: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not replay.poll(100):
                    continue
                identity, *frames = replay.recv_multipart()
                if len(frames) != 1 or len(frames[0]) != 8:
                    continue  # not our protocol: ignore
                # One answer per connection, as a subscriber asks (a socket per replay or
                # snapshot): a peer asking again and again on one connection had the whole
                # buffer replayed each time, ~27 ms of this thread per 8-byte request.
                if identity in self._answered_peers:
                    continue
                self._answered_peers[identity] = None
                if len(self._answered_peers) > _ANSWERED_PEERS:
                    self._answered_peers.popitem(last=False)
                if frames[0] == _SNAPSHOT:
                    replay.send_multipart([identity, _SNAPSHOT, self._snapshot()], copy=False)
                    continue
                (start,) = struct.unpack(">q", frames[0])
                with self._lock:
                    buffered = [item for item in self._buffer if item[0] >= start]
                for seq, payload in buffered:  # (queued replies share the buffer's bytes)
                    replay.send_multipart([identity, struct.pack(">q", seq), payload],
                                          copy=False)  # fmt: skip
                replay.send_multipart([identity, _END, b""])
        except zmq.ZMQError as exc:
            logger.warning("KV event replays stopped: %s", exc)
        finally:
            replay.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pub.close(0)


@dataclass(slots=True)
class SubscriberState:
    next_seq: int | None = None
    received: int | None = None  # the highest sequence number the SUB socket brought
    epoch: bytes = b""  # the publisher's (module docstring)
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    snapshots: int = 0
    batches: list[KVEventBatch] = field(default_factory=list)


class KVEventSubscriber:
    """Receives one worker's batches in order, filling gaps from its replay socket.

    ``poll(timeout_ms)`` returns the batches that arrived (in sequence order) and whether
    the subscriber had to resynchronise (some batches are lost for good: the caller must
    drop what it knows of this worker first)."""

    def __init__(self, pub_endpoint: str, replay_endpoint: str, replay_timeout_s: float = 2.0):
        self._ctx = zmq.Context.instance()
        self._sub = tcp_socket(self._ctx, zmq.SUB, endpoint_host(pub_endpoint))
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(pub_endpoint)
        self._pub_endpoint = pub_endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_host = endpoint_host(replay_endpoint)
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.state = SubscriberState()
        self._num_unreadable = 0
        self._unreadable_logged_at = -_UNREADABLE_LOG_S

    def _decode_or_none(self, payload: bytes) -> KVEventBatch | None:
        """A batch, or None if this process cannot read it (a newer worker's event type
        during a rolling upgrade, a damaged message). Said once a minute per worker, with
        a count: a traceback per batch filled the router's log as the worker's cache
        changed (200 batches: 1800 lines)."""
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._num_unreadable += 1
            now = time.monotonic()
            if now - self._unreadable_logged_at >= _UNREADABLE_LOG_S:
                self._unreadable_logged_at = now
                logger.warning("dropping KV event batches from %s that this process cannot "
                               "read (%d so far; a newer worker's events?): %s",
                               self._pub_endpoint, self._num_unreadable, exc)  # fmt: skip
            return None

    @property
    def socket(self) -> zmq.Socket:
        return self._sub

    def poll(self, timeout_ms: int = 0) -> tuple[list[KVEventBatch], bool]:
        batches: list[KVEventBatch] = []
        resync = False
        state = self.state
        while self._sub.poll(timeout_ms):
            timeout_ms = 0
            topic, seq_bytes, payload = self._sub.recv_multipart()
            (seq,) = struct.unpack(">q", seq_bytes)
            heartbeat = not payload  # then ``seq`` is the publisher's last batch
            epoch = topic[len(TOPIC) :]  # (empty from a publisher before epochs)
            if state.received is not None and (epoch != state.epoch or seq < state.received):
                # Another epoch, or behind what this connection brought before (batches
                # and heartbeats come in order on it, a heartbeat after the batch it
                # names): the publisher started over (the worker restarted on the same
                # ports). Its batches would read as seen already: forget the old ones and
                # join the new. (Measured against ``next_seq`` instead, a heartbeat sent
                # before a snapshot and read after it looked like a restart.)
                state.resyncs += 1
                batches, resync, state.next_seq = [], True, None
                state.received = None
            state.epoch = epoch
            state.received = seq if state.received is None else max(state.received, seq)
            if state.next_seq is None:  # joining: the worker's cache as it is now
                batches += self._join(seq if heartbeat else seq - 1)
            expected = state.next_seq
            assert expected is not None
            if heartbeat:
                if seq >= expected:  # (a snapshot made a moment before is older than it)
                    batches, resync = self._catch_up(batches, resync, expected, seq + 1)
                continue
            if seq < expected:
                continue  # already seen (through a replay or a snapshot)
            if seq > expected:
                batches, resync = self._catch_up(batches, resync, expected, seq)
                if seq < state.next_seq:
                    continue  # (the snapshot it resynchronised from holds this batch)
            batch = self._decode_or_none(payload)
            if batch is None:  # what it changed is unknown: resynchronise
                state.resyncs += 1
                snapshot = self._snapshot()
                if snapshot is not None and snapshot.seq >= seq:
                    batches, resync, state.next_seq = [snapshot], True, snapshot.seq + 1
                    continue
                batches, resync = [], True
            else:
                batches.append(batch)
            state.next_seq = seq + 1
        return batches, resync

    def _join(self, last: int) -> list[KVEventBatch]:
        """The worker's blocks as a snapshot, and ``next_seq`` past it; from a publisher
        without snapshots, what its buffer holds up to ``last``, the batch before the
        one being read (its replay read once to its end: the snapshot request got it)."""
        snapshot = self._snapshot()
        if snapshot is not None:
            self.state.next_seq = snapshot.seq + 1
            return [snapshot]
        self.state.next_seq = last + 1
        return self._replay(0, last + 1)[0] if last >= 0 else []

    def _catch_up(
        self, batches: list[KVEventBatch], resync: bool, start: int, stop: int
    ) -> tuple[list[KVEventBatch], bool]:
        """Fill the gap [start, stop) after ``batches``, and set ``next_seq`` to ``stop``.
        If the replay had holes, the caller must resynchronise: from a snapshot (and
        ``next_seq`` past it, or the batches after it when it is older than ``stop``:
        one made for another subscriber within the second), else from the run of batches
        after the last hole."""
        self.state.gaps += 1
        replayed, complete = self._replay(start, stop)
        self.state.next_seq = stop
        if complete:
            return batches + replayed, resync
        self.state.resyncs += 1
        snapshot = self._snapshot()
        if snapshot is None:
            return replayed, True
        if snapshot.seq + 1 >= stop:
            self.state.next_seq = snapshot.seq + 1
            return [snapshot], True
        after, complete = self._replay(snapshot.seq + 1, stop)
        return ([snapshot, *after] if complete else after), True

    def _snapshot(self) -> KVEventBatch | None:
        """The publisher's snapshot; None if it has none to give (it predates them: it
        replays instead, which is read to its end) or does not answer in time."""
        dealer = tcp_socket(self._ctx, zmq.DEALER, self._replay_host)
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send(_SNAPSHOT)
            while dealer.poll(self._replay_timeout_ms):
                seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == _SNAPSHOT:
                    snapshot = self._decode_or_none(payload)
                    self.state.snapshots += snapshot is not None
                    return snapshot
                if seq_bytes == _END:
                    return None
            return None
        finally:
            dealer.close(0)

    def _replay(self, start: int, stop: int) -> tuple[list[KVEventBatch], bool]:
        """Batches [start, stop) from the replay socket; complete=False if some are gone.
        Then only the run of batches that ends at ``stop - 1`` without a hole comes back:
        a block removed in a hole would otherwise stay known for good."""
        dealer = tcp_socket(self._ctx, zmq.DEALER, self._replay_host)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.connect(self._replay_endpoint)
        got: list[KVEventBatch] = []
        try:
            dealer.send(struct.pack(">q", start))
            while dealer.poll(self._replay_timeout_ms):
                seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == _END:
                    break
                (seq,) = struct.unpack(">q", seq_bytes)
                batch = self._decode_or_none(payload) if start <= seq < stop else None
                if batch is not None:  # an unreadable one counts as a hole
                    got.append(batch)
        finally:
            dealer.close(0)
        self.state.replayed += len(got)
        complete = [b.seq for b in got] == list(range(start, stop))
        if not complete:
            first = len(got)
            while first and got[first - 1].seq == stop - (len(got) - first) - 1:
                first -= 1
            got = got[first:]
        return got, complete

    def close(self) -> None:
        self._sub.close(0)
