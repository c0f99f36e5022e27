"""A block-pool observer that records what it sees, for tests."""

from __future__ import annotations

from collections.abc import Sequence

from common.hashing import BlockHash
from engine.block_pool import KVBlock


class EventRecorder:
    def __init__(self) -> None:
        self.stored: list[list[BlockHash]] = []
        self.removed: list[BlockHash] = []
        self.cleared = 0
        self.states_stored: list[BlockHash] = []
        self.states_removed: list[BlockHash] = []

    def on_blocks_stored(
        self,
        blocks: Sequence[KVBlock],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        assert len(token_ids) == len(blocks) * block_size
        self.stored.append([block.block_hash for block in blocks])

    def on_block_evicted(self, block: KVBlock, block_hash: BlockHash) -> None:
        self.removed.append(block_hash)

    def on_all_cleared(self, block_hashes) -> None:
        self.cleared += 1

    def on_states_stored(self, follows: Sequence[BlockHash]) -> None:
        self.states_stored.extend(follows)

    def on_states_removed(self, follows: Sequence[BlockHash]) -> None:
        self.states_removed.extend(follows)
