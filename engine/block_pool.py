"""The pool of KV blocks: reference counts, the prefix cache and LRU eviction. Torch-free.

A block is *free* when no request holds it (``ref_cnt == 0``). A free block may still be
*cached*: it keeps its hash and its KV, and a later request with the same prefix takes it
back instead of recomputing. Free blocks wait in an LRU queue; allocation takes the least
recently freed one and, if it was cached, evicts it from the cache first.

A hybrid model's cache also keeps *state snapshots*: the linear-attention states after a
cached prefix, in ordinary blocks registered under names derived from the prefix's last
block (``common.hashing.state_block_hashes``; ``kv_cache_manager.py``). They are evicted
like any cached block; observers see them only as whole snapshots, named by the block
they follow (``on_states_stored`` / ``on_states_removed``: where a router may count a
prefix as reusable), and ``on_state_evicted`` sees their blocks go (the CPU tier, which
keeps snapshots too).

Observers see every block that enters or leaves the cache. The KV-event publisher is one;
the CPU offload tier is another (it copies a block out before its slot is reused).

    free queue (LRU → MRU):  [b7 h=..] [b2] [b9 h=..] ...   allocate() pops from the left
    cached_blocks:           {hash → block}, only blocks whose KV is valid
    state_blocks:            {name → block}, state snapshots (hybrid models)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPoolObserver(Protocol):
    """Sees the prefix cache change. Called synchronously, before the change is visible to
    the next allocation, so an observer may still read an evicted block's KV."""

    def on_blocks_stored(
        self,
        blocks: Sequence[KVBlock],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None: ...

    def on_block_evicted(self, block: KVBlock, block_hash: BlockHash) -> None: ...

    def on_all_cleared(self, block_hashes: Sequence[BlockHash]) -> None:
        """``reset_prefix_cache`` forgot ``block_hashes``, every block this pool cached."""

    def on_states_stored(self, follows: Sequence[BlockHash]) -> None:
        """Hybrid models: a whole state snapshot is now cached after each of these blocks."""

    def on_states_removed(self, follows: Sequence[BlockHash]) -> None:
        """Hybrid models: the snapshots after these blocks are whole no more (a block of
        each was evicted or renamed, or the cache was reset)."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        observers: Iterable[BlockPoolObserver] = (),
        on_state_evicted: Callable[[KVBlock, BlockHash], None] | None = None,
    ) -> None:
        """``on_state_evicted(block, name)``: a state snapshot's block is evicted (called
        like ``BlockPoolObserver.on_block_evicted``, while its bytes are intact)."""
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.state_blocks: dict[BlockHash, KVBlock] = {}
        # Each whole snapshot's names by the block it follows, and back: observers hear
        # of a snapshot once when it is cached and once when it stops being whole.
        self._snapshot_names: dict[BlockHash, list[BlockHash]] = {}
        self._snapshot_follows: dict[BlockHash, BlockHash] = {}
        self.observers: list[BlockPoolObserver] = list(observers)
        self.on_state_evicted = on_state_evicted
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_state_block(self, name: BlockHash) -> KVBlock | None:
        return self.state_blocks.get(name)

    def cache_state_blocks(
        self, blocks: Sequence[KVBlock], names: Sequence[BlockHash], follows: BlockHash
    ) -> bool:
        """Register a state snapshot's blocks under their names (derived from ``follows``,
        the hash of the block it follows), unless a block under one of those names is
        cached already (then they stay plain blocks). Returns whether they were
        registered."""
        if not self.enable_caching or any(name in self.state_blocks for name in names):
            return False
        for block, name in zip(blocks, names, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is cached already"
            block.block_hash = name
            self.state_blocks[name] = block
            self._snapshot_follows[name] = follows
        self._snapshot_names[follows] = list(names)
        for observer in self.observers:
            observer.on_states_stored([follows])
        return True

    def uncache_state_blocks(self, names: Sequence[BlockHash]) -> None:
        """Forget a state snapshot's names (its blocks are about to hold another one);
        names no longer cached are skipped."""
        for name in names:
            self._break_snapshot(name)
            block = self.state_blocks.pop(name, None)
            if block is not None:
                block.block_hash = None

    def _break_snapshot(self, name: BlockHash) -> None:
        """The snapshot with a block named ``name`` is whole no more: tell observers once
        (its other blocks stay cached until evicted, found by no lookup)."""
        follows = self._snapshot_follows.pop(name, None)
        if follows is None:
            return
        for other in self._snapshot_names.pop(follows):
            self._snapshot_follows.pop(other, None)
        for observer in self.observers:
            observer.on_states_removed([follows])

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks, evicting cached ones least recently used first."""
        if num_blocks > len(self._free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free_queue)} free")
        allocated = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. Pass blocks in eviction order: a block freed
        earlier is evicted earlier, so callers free a sequence's tail before its prefix."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def refresh(self, blocks: Iterable[KVBlock]) -> None:
        """Move free blocks to the most recently used end of the free queue (evicted
        last so far); held ones are left alone."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_queue.move_to_end(block.block_id)

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Register full blocks under their hashes. ``token_ids`` are the blocks' tokens.

        A hash already cached under another block (two requests computed the same content
        at once) keeps its first block; the duplicate stays uncached and is reused as plain
        free space once released.
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes) and len(token_ids) == len(blocks) * block_size
        stored: list[KVBlock] = []
        stored_parent = parent_hash
        stored_tokens: list[int] = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is not None or block_hash in self.cached_blocks:
                self._notify_stored(stored, stored_parent, stored_tokens, block_size)
                stored, stored_tokens, stored_parent = [], [], block_hash
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            stored.append(block)
            stored_tokens.extend(token_ids[i * block_size : (i + 1) * block_size])
        self._notify_stored(stored, stored_parent, stored_tokens, block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block of this pool. Only possible when no block is in use.
        A CPU tier keeps what it holds (its observer drops only saves not yet made):
        lookups still hit there."""
        if self.num_used_blocks:
            return False
        forgotten = list(self.cached_blocks)
        snapshots = list(self._snapshot_names)
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        self.state_blocks.clear()
        self._snapshot_names.clear()
        self._snapshot_follows.clear()
        for observer in self.observers:
            if snapshots:
                observer.on_states_removed(snapshots)
            observer.on_all_cleared(forgotten)
        return True

    def leak_report(self) -> list[str]:
        """What is still held. Empty when every block is free."""
        problems = [
            f"block {block.block_id} ref_cnt={block.ref_cnt}"
            for block in self.blocks
            if block.ref_cnt != 0
        ]
        if len(self._free_queue) != self.num_blocks and not problems:
            problems.append(f"free queue holds {len(self._free_queue)}/{self.num_blocks}")
        for block_hash, block in [*self.cached_blocks.items(), *self.state_blocks.items()]:
            if block.block_hash != block_hash:
                problems.append(f"cache entry for block {block.block_id} has a stale hash")
        stale = [name for name in self._snapshot_follows if name not in self.state_blocks]
        problems += [f"snapshot bookkeeping names uncached block {n.hex()[:12]}" for n in stale]
        return problems

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        if self.state_blocks.get(block_hash) is block:  # part of a snapshot: the rest
            del self.state_blocks[block_hash]  # stays until evicted, found by no lookup
            self._break_snapshot(block_hash)
            self.num_evictions += 1
            if self.on_state_evicted is not None:
                self.on_state_evicted(block, block_hash)
            return
        if self.cached_blocks.get(block_hash) is block:
            del self.cached_blocks[block_hash]
            self.num_evictions += 1
            for observer in self.observers:
                observer.on_block_evicted(block, block_hash)

    def _notify_stored(
        self,
        blocks: list[KVBlock],
        parent_hash: BlockHash | None,
        token_ids: list[int],
        block_size: int,
    ) -> None:
        if not blocks:
            return
        for observer in self.observers:
            observer.on_blocks_stored(blocks, parent_hash, token_ids, block_size)
