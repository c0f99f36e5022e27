"""Turns block-pool changes into KV events (``common/kv_events.py``) for publishers.

The collector is a ``BlockPoolObserver``; the engine drains it once per step and hands the
batch to whatever publishes it (a ZMQ PUB socket in the services, nothing offline).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.hashing import BlockHash
from common.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
    StateRemoved,
    StateStored,
)
from engine.block_pool import KVBlock


class KVEventCollector:
    def __init__(self, medium: Medium = Medium.GPU) -> None:
        self.medium = medium
        self._events: list[KVEvent] = []

    def on_blocks_stored(
        self,
        blocks: Sequence[KVBlock],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        hashes = [block.block_hash for block in blocks]
        assert all(h is not None for h in hashes)
        # Without the blocks' tokens: nothing reads them (the router indexes hashes), and
        # they put every cached prompt in the clear on the events port, which any peer
        # on the network may subscribe to (``common/internal_auth.py`` covers gRPC only).
        self._events.append(BlockStored(hashes, parent_hash, [], block_size, self.medium))

    def on_block_evicted(self, block: KVBlock, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == self.medium:
            last.block_hashes.append(block_hash)  # coalesce evictions of one allocation
        else:
            self._events.append(BlockRemoved([block_hash], self.medium))

    def on_all_cleared(self, block_hashes: Sequence[BlockHash]) -> None:
        # Removed one by one, not AllBlocksCleared: that says every tier is gone, and a
        # CPU tier keeps its blocks (the router dropped them from its index).
        if block_hashes:
            self._events.append(BlockRemoved(list(block_hashes), self.medium))

    def on_states_stored(self, follows: Sequence[BlockHash]) -> None:
        self._add_states(StateStored, follows)

    def on_states_removed(self, follows: Sequence[BlockHash]) -> None:
        self._add_states(StateRemoved, follows)

    def _add_states(
        self, kind: type[StateStored] | type[StateRemoved], follows: Sequence[BlockHash]
    ) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, kind):
            last.block_hashes.extend(follows)  # coalesce a step's snapshots
        else:
            self._events.append(kind(list(follows)))

    def emit(self, event: KVEvent) -> None:
        """An event from elsewhere (the CPU tier), kept in order with the pool's."""
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
