"""KV-cache events: what a worker tells routers about the blocks it caches.

Events are tagged msgspec structs so that they encode to compact msgpack and decode
without pickle. A worker batches the events of one engine step into a ``KVEventBatch``
with a per-publisher sequence number; a router that sees a gap asks for a replay.

``medium`` names the tier that holds the block: ``gpu`` is the engine's primary KV pool
(on whatever device the engine runs, CPU included), ``cpu`` the CPU offload tier.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class Medium(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


class BlockStored(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Blocks newly cached, in prefix order; ``parent_block_hash`` precedes the first one."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: Medium = Medium.GPU


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Blocks no longer held by this tier."""

    block_hashes: list[bytes]
    medium: Medium = Medium.GPU


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Every block of every tier is gone, and every state snapshot: what a snapshot of
    the cache begins with (a worker that joins or restarts). A pool's
    ``reset_prefix_cache`` removes its blocks one by one instead, since a CPU tier keeps
    its own."""


class StateStored(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Hybrid models: the worker now caches a state snapshot (its linear-attention states)
    after each of these blocks, on the device, so a prompt that runs past one of them can
    start there instead of recomputing from its first token (``engine/kv_cache_manager.py``).
    A prefix of cached blocks without one is KV the engine cannot resume from."""

    block_hashes: list[bytes]


class StateRemoved(msgspec.Struct, tag=True, frozen=True, array_like=True):
    """Hybrid models: the snapshots after these blocks are gone from the device (evicted,
    or moved on by a rolling snapshot)."""

    block_hashes: list[bytes]


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared
StateEvent = StateStored | StateRemoved
KVEvent = BlockEvent | StateEvent  # (in a process: one list, in order)


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True):
    """The events of one engine step. ``seq`` increases by one per batch per publisher.

    A hybrid model's state events travel in ``states``, after the block events, not among
    them: a router from before them decodes a batch's first three fields and skips the
    rest, where an unknown tag among ``events`` made it refuse every batch and its
    snapshot, and forget every block the worker holds (a review, 2026-12-01). Applied
    after the batch's block events (the index keeps states apart from blocks)."""

    seq: int
    ts: float
    events: list[BlockEvent]
    states: list[StateEvent] = []

    @classmethod
    def of(cls, seq: int, ts: float, events: list[KVEvent]) -> KVEventBatch:
        """A batch of one step's ``events``, in order, each kind in its field."""
        states = [event for event in events if isinstance(event, StateStored | StateRemoved)]
        blocks = [event for event in events if not isinstance(event, StateStored | StateRemoved)]
        return cls(seq, ts, blocks, states)

    def all_events(self) -> list[KVEvent]:
        """The block events, then the state events."""
        return [*self.events, *self.states]


class _ReadBatch(msgspec.Struct, frozen=True, array_like=True):
    """A batch as read off the wire: state events may also be among ``events``, where
    workers of the builds between their introduction and ``states`` put them (a new
    router refused each of their batches and snapshots, and forgot their blocks: a
    rolling-upgrade audit, 2026-12-01)."""

    seq: int
    ts: float
    events: list[KVEvent]
    states: list[StateEvent] = []


# Built here, at import, on one thread: msgspec fills its per-type caches (the Medium
# enum's lookup table among them) the first time it meets a type, calling back into Python
# as it does, and two router threads decoding their first batches at once crashed a test
# process in that window (a segfault inside decode_batch, a CI run on 2026-11-29).
# Decoders are immutable and thread-safe once built.
_BATCH_DECODER = msgspec.msgpack.Decoder(_ReadBatch)
_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    read = _BATCH_DECODER.decode(data)
    if any(isinstance(event, StateStored | StateRemoved) for event in read.events):
        return KVEventBatch.of(read.seq, read.ts, [*read.events, *read.states])
    return KVEventBatch(read.seq, read.ts, read.events, read.states)  # type: ignore[arg-type]
