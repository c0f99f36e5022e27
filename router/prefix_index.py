"""Which worker caches which blocks, fed by the workers' KV events. Torch-free.

    gpu / cpu:   block hash → {worker ids}                (what events confirmed, per tier)
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


_EMPTY: frozenset[str] = frozenset()


class PrefixIndex:
    def __init__(self, optimistic_ttl_s: float = 30.0) -> None:
        self.optimistic_ttl_s = optimistic_ttl_s
        # Per tier, block hash → the workers holding it (sets: ``match`` intersects them).
        self._gpu: dict[BlockHash, set[str]] = {}
        self._cpu: dict[BlockHash, set[str]] = {}
        # Optimistic entries: block hash → {worker id → expiry}; ``expire_optimistic``
        # (called periodically) drops old ones, ``match`` takes the rest at face value.
        self._optimistic: dict[BlockHash, dict[str, float]] = {}
        self._worker_blocks: dict[str, set[BlockHash]] = {}

    def _tier(self, medium: Medium) -> dict[BlockHash, set[str]]:
        return self._cpu if medium is Medium.CPU else self._gpu

    # ------------------------------------------------------------------ updates

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        held = self._worker_blocks.setdefault(worker_id, set())
        for event in events:
            if isinstance(event, BlockStored):
                tier = self._tier(event.medium)
                for block_hash in event.block_hashes:
                    tier.setdefault(block_hash, set()).add(worker_id)
                    held.add(block_hash)
                    self._drop_optimistic(block_hash, worker_id)
            elif isinstance(event, BlockRemoved):
                tier = self._tier(event.medium)
                for block_hash in event.block_hashes:
                    owners = tier.get(block_hash)
                    if owners is None or worker_id not in owners:
                        continue
                    owners.discard(worker_id)
                    if not owners:
                        del tier[block_hash]
                    if not self._holds_any(block_hash, worker_id):
                        held.discard(block_hash)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(worker_id)
                held = self._worker_blocks.setdefault(worker_id, set())

    def _holds_any(self, block_hash: BlockHash, worker_id: str) -> bool:
        return worker_id in self._gpu.get(block_hash, _EMPTY) or worker_id in self._cpu.get(
            block_hash, _EMPTY
        )

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
            for tier in (self._gpu, self._cpu):
                owners = tier.get(block_hash)
                if owners is not None:
                    owners.discard(worker_id)
                    if not owners:
                        del tier[block_hash]
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
        """The leading run of ``block_hashes`` each worker holds. Set operations per block,
        so the cost grows with the matched prefix, barely with the number of workers."""
        active = set(worker_ids)
        run = dict.fromkeys(worker_ids, 0)
        cpu = dict.fromkeys(worker_ids, 0)
        gpu_tier, cpu_tier, optimistic = self._gpu, self._cpu, self._optimistic
        depth = 0
        for depth, block_hash in enumerate(block_hashes):
            on_gpu = gpu_tier.get(block_hash, _EMPTY)
            on_cpu = cpu_tier.get(block_hash, _EMPTY)
            hopeful = optimistic.get(block_hash)
            holders = active & on_gpu
            if hopeful:
                holders |= active & hopeful.keys()
            if on_cpu:
                cpu_only = (active & on_cpu) - holders
                for worker_id in cpu_only:
                    cpu[worker_id] += 1
                holders |= cpu_only
            for worker_id in active - holders:
                run[worker_id] = depth
            active = holders
            if not active:
                break
        else:
            depth = len(block_hashes)
        for worker_id in active:
            run[worker_id] = depth
        return {w: PrefixMatch(run[w] - cpu[w], cpu[w]) for w in worker_ids}

    def num_blocks(self, worker_id: str) -> int:
        return len(self._worker_blocks.get(worker_id, ()))
