"""Which worker caches which blocks, fed by the workers' KV events. Torch-free.

    blocks:      block hash → {worker id → medium}        (what events confirmed)
    optimistic:  block hash → {worker id → expiry}        (what we just sent there)

A prompt's blocks form a chain (each hash covers its whole prefix), so a worker can reuse
the *leading run* of the prompt's hashes it holds; ``match`` returns that run per worker,
split by tier. Optimistic entries let a burst of requests sharing a prefix co-locate before
the first one's events arrive; they expire unless events confirm them.

Not thread-safe by itself: the router applies events and queries under one lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.hashing import BlockHash
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    gpu_blocks: int = 0  # leading blocks held in the worker's primary pool (or in flight)
    cpu_blocks: int = 0  # leading blocks only in its CPU tier

    @property
    def num_blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


class PrefixIndex:
    def __init__(self, optimistic_ttl_s: float = 30.0) -> None:
        self.optimistic_ttl_s = optimistic_ttl_s
        self._blocks: dict[BlockHash, dict[str, Medium]] = {}
        self._optimistic: dict[BlockHash, dict[str, float]] = {}
        self._worker_blocks: dict[str, set[BlockHash]] = {}

    # ------------------------------------------------------------------ updates

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        held = self._worker_blocks.setdefault(worker_id, set())
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self._blocks.setdefault(block_hash, {})[worker_id] = event.medium
                    held.add(block_hash)
                    self._drop_optimistic(block_hash, worker_id)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._remove(block_hash, worker_id, event.medium, held)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(worker_id)
                held = self._worker_blocks.setdefault(worker_id, set())

    def _remove(
        self, block_hash: BlockHash, worker_id: str, medium: Medium, held: set[BlockHash]
    ) -> None:
        owners = self._blocks.get(block_hash)
        if owners is None or owners.get(worker_id) != medium:
            return  # a block moved tiers: the removal of its old copy arrives after
        del owners[worker_id]
        if not owners:
            del self._blocks[block_hash]
        held.discard(block_hash)

    def insert_optimistic(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        expiry = time.monotonic() + self.optimistic_ttl_s
        for block_hash in block_hashes:
            self._optimistic.setdefault(block_hash, {})[worker_id] = expiry

    def _drop_optimistic(self, block_hash: BlockHash, worker_id: str) -> None:
        owners = self._optimistic.get(block_hash)
        if owners is not None:
            owners.pop(worker_id, None)
            if not owners:
                del self._optimistic[block_hash]

    def clear_worker(self, worker_id: str) -> None:
        """Forget everything about a worker (it left, restarted or needs a resync)."""
        for block_hash in self._worker_blocks.pop(worker_id, set()):
            owners = self._blocks.get(block_hash)
            if owners is not None:
                owners.pop(worker_id, None)
                if not owners:
                    del self._blocks[block_hash]
        for block_hash in [h for h, o in self._optimistic.items() if worker_id in o]:
            self._drop_optimistic(block_hash, worker_id)

    def expire_optimistic(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = 0
        for block_hash in list(self._optimistic):
            owners = self._optimistic[block_hash]
            for worker_id in [w for w, t in owners.items() if t <= now]:
                del owners[worker_id]
                expired += 1
            if not owners:
                del self._optimistic[block_hash]
        return expired

    # ------------------------------------------------------------------ queries

    def match(
        self, block_hashes: Sequence[BlockHash], worker_ids: Sequence[str]
    ) -> dict[str, PrefixMatch]:
        """The leading run of ``block_hashes`` each worker holds."""
        now = time.monotonic()
        gpu = dict.fromkeys(worker_ids, 0)
        cpu = dict.fromkeys(worker_ids, 0)
        active = set(worker_ids)
        for block_hash in block_hashes:
            if not active:
                break
            owners = self._blocks.get(block_hash, {})
            hopeful = self._optimistic.get(block_hash, {})
            for worker_id in list(active):
                medium = owners.get(worker_id)
                if medium is Medium.GPU or (medium is None and hopeful.get(worker_id, 0) > now):
                    gpu[worker_id] += 1
                elif medium is Medium.CPU:
                    cpu[worker_id] += 1
                else:
                    active.discard(worker_id)
        return {w: PrefixMatch(gpu[w], cpu[w]) for w in worker_ids}

    def num_blocks(self, worker_id: str) -> int:
        return len(self._worker_blocks.get(worker_id, ()))
