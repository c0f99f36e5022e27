"""Which worker caches which blocks, fed by the workers' KV events. Torch-free.

    gpu / cpu:   block hash → bit mask of worker ids      (what events confirmed, per tier)
    optimistic:  block hash → {worker id → expiry}        (what we just sent there)
    states:      block hash → bit mask of worker ids      (a state snapshot follows it there)

A prompt's blocks form a chain (each hash covers its whole prefix), so a worker can reuse
the *leading run* of the prompt's hashes it holds; ``match`` returns that run per worker,
split by tier. Optimistic entries let a burst of requests sharing a prefix co-locate before
the first one's events arrive; they expire unless events confirm them.

A hybrid model's worker can resume a prompt only where it caches a state snapshot after a
block of it (``StateStored``): ``match`` also says how much of each run ends at one
(``resumable_blocks``). Other models send no such events.

Not thread-safe by itself: the router applies events and queries under one lock.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from common.hashing import BlockHash
from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    Medium,
    StateRemoved,
    StateStored,
)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    gpu_blocks: int = 0  # leading blocks held in the worker's primary pool (or in flight)
    cpu_blocks: int = 0  # leading blocks only in its CPU tier
    # Hybrid models: the leading blocks of the run (either tier) that end where the
    # worker caches a state snapshot: what it can resume from (0 for other models).
    resumable_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


class PrefixIndex:
    """Owners are bit masks over worker *slots* (one bit per worker id, reused after a
    worker leaves): ``match`` intersects ints instead of sets, and the big maps hold only
    bytes and ints, which CPython's cycle collector does not track, so a million-block index
    adds no GC pauses to routing decisions."""

    def __init__(self, optimistic_ttl_s: float = 30.0) -> None:
        self.optimistic_ttl_s = optimistic_ttl_s
        # Per tier, block hash → bit mask of the workers holding it.
        self._gpu: dict[BlockHash, int] = {}
        self._cpu: dict[BlockHash, int] = {}
        # Block hash → bit mask of the workers caching a state snapshot after it (device).
        self._states: dict[BlockHash, int] = {}
        # Optimistic entries: block hash → {worker id → expiry}; ``expire_optimistic``
        # (called periodically) drops old ones, ``match`` takes the rest at face value.
        self._optimistic: dict[BlockHash, dict[str, float]] = {}
        # (expiry, block hash, worker id), one per claim, a heap: expiring costs what
        # expires, not a scan of every entry under the lock (~0.6 s at a million
        # entries). A claim renewed since goes back in with its new expiry; one dropped
        # since is skipped. (A queue in insertion order, taken for expiry order, put a
        # renewed claim behind later ones: it outlived its expiry by up to a TTL.)
        self._expiries: list[tuple[float, BlockHash, str]] = []
        # Per worker, the hashes it holds in either tier (a dict used as an ordered set).
        self._worker_blocks: dict[str, dict[BlockHash, None]] = {}
        self._worker_states: dict[str, dict[BlockHash, None]] = {}  # the same, for states
        self._bits: dict[str, int] = {}  # worker id → its bit (1 << slot)
        self._free_bits: list[int] = []
        self._num_slots = 0
        # Cleared workers' bits still set in the maps, with the hashes to take them from
        # (``sweep``); a bit is free again once none is left.
        self._retiring: deque[tuple[int, Iterator[BlockHash], Iterator[BlockHash]]] = deque()

    def _bit(self, worker_id: str) -> int:
        bit = self._bits.get(worker_id)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._num_slots = 1 << self._num_slots, self._num_slots + 1
            self._bits[worker_id] = bit
        return bit

    def _tier(self, medium: Medium) -> dict[BlockHash, int]:
        return self._cpu if medium is Medium.CPU else self._gpu

    # ------------------------------------------------------------------ updates

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        bit = self._bit(worker_id)
        held = self._worker_blocks.setdefault(worker_id, {})
        for event in events:
            if isinstance(event, BlockStored):
                tier = self._tier(event.medium)
                for block_hash in event.block_hashes:
                    tier[block_hash] = tier.get(block_hash, 0) | bit
                    held[block_hash] = None
                    self._drop_optimistic(block_hash, worker_id)
            elif isinstance(event, BlockRemoved):
                tier = self._tier(event.medium)
                for block_hash in event.block_hashes:
                    self._drop_optimistic(block_hash, worker_id)  # not there now, whatever we sent
                    if not tier.get(block_hash, 0) & bit:
                        continue
                    _without_bit(tier, block_hash, bit)
                    if not (self._gpu.get(block_hash, 0) | self._cpu.get(block_hash, 0)) & bit:
                        held.pop(block_hash, None)
            elif isinstance(event, StateStored):
                states = self._worker_states.setdefault(worker_id, {})
                for block_hash in event.block_hashes:
                    self._states[block_hash] = self._states.get(block_hash, 0) | bit
                    states[block_hash] = None
            elif isinstance(event, StateRemoved):
                states = self._worker_states.get(worker_id, {})
                for block_hash in event.block_hashes:
                    if block_hash in states:
                        del states[block_hash]
                        _without_bit(self._states, block_hash, bit)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(worker_id)
                bit = self._bit(worker_id)
                held = self._worker_blocks.setdefault(worker_id, {})

    def insert_optimistic(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        self._bit(worker_id)
        expiry = time.monotonic() + self.optimistic_ttl_s
        for block_hash in block_hashes:
            owners = self._optimistic.setdefault(block_hash, {})
            if worker_id not in owners:  # a renewal keeps its place in the queue
                heapq.heappush(self._expiries, (expiry, block_hash, worker_id))
            owners[worker_id] = expiry

    def withdraw_optimistic(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The blocks did not go to ``worker_id`` after all (it failed, or the request
        ended before it got them)."""
        for block_hash in block_hashes:
            self._drop_optimistic(block_hash, worker_id)

    def _drop_optimistic(self, block_hash: BlockHash, worker_id: str) -> None:
        owners = self._optimistic.get(block_hash)
        if owners is not None:
            owners.pop(worker_id, None)
            if not owners:
                del self._optimistic[block_hash]

    def clear_worker(self, worker_id: str) -> None:
        """Forget everything about a worker (it left, restarted or needs a resync). Its
        bit leaves the worker at once, so ``match`` never sees it again; taking the bit
        off each of its blocks is ``sweep``'s, a slice at a time (all at once, under the
        lock every placement waits for, took 226 ms at 300k blocks), and the bit is free
        for the next worker id after that."""
        bit = self._bits.pop(worker_id, 0)
        blocks = self._worker_blocks.pop(worker_id, {})
        states = self._worker_states.pop(worker_id, {})
        for block_hash in [h for h, o in self._optimistic.items() if worker_id in o]:
            self._drop_optimistic(block_hash, worker_id)
        if bit:
            self._retiring.append((bit, iter(blocks), iter(states)))

    @property
    def sweeping(self) -> bool:
        """Whether a cleared worker's bit is still set on some blocks (``sweep``)."""
        return bool(self._retiring)

    def sweep(self, max_blocks: int = 4096) -> None:
        """Take cleared workers' bits off up to ``max_blocks`` blocks (~3 ms); a bit
        taken off all of its blocks is free again."""
        while self._retiring and max_blocks > 0:
            bit, blocks, states = self._retiring[0]
            for block_hash in blocks:
                _without_bit(self._gpu, block_hash, bit)
                _without_bit(self._cpu, block_hash, bit)
                max_blocks -= 1
                if max_blocks <= 0:
                    return
            for block_hash in states:
                _without_bit(self._states, block_hash, bit)
                max_blocks -= 1
                if max_blocks <= 0:
                    return
            self._retiring.popleft()
            self._free_bits.append(bit)

    def expire_optimistic(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = 0
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, block_hash, worker_id = heapq.heappop(expiries)
            expiry = self._optimistic.get(block_hash, {}).get(worker_id)
            if expiry is None:
                continue  # confirmed or withdrawn meanwhile
            if expiry > now:  # renewed meanwhile
                heapq.heappush(expiries, (expiry, block_hash, worker_id))
                continue
            self._drop_optimistic(block_hash, worker_id)
            expired += 1
        return expired

    # ------------------------------------------------------------------ queries

    def match(
        self,
        block_hashes: Sequence[BlockHash],
        worker_ids: Sequence[str],
        optimistic: bool = True,
    ) -> dict[str, PrefixMatch]:
        """The leading run of ``block_hashes`` each worker holds (``optimistic=False``:
        only what events confirmed). A few int operations per block, so the cost grows
        with the matched prefix, barely with the number of workers; per-worker bookkeeping
        happens only when a worker's run ends."""
        bits = {w: self._bits.get(w, 0) for w in worker_ids}
        active = 0
        for bit in bits.values():
            active |= bit
        run: dict[int, int] = {}  # bit → depth where its run ended
        cpu: dict[int, int] = {}  # bit → CPU-only blocks in its run
        resumable: dict[int, int] = {}  # bit → depth of the last state in its run
        gpu_tier, cpu_tier, states = self._gpu, self._cpu, self._states
        optimistic_tier = self._optimistic if optimistic else {}
        depth = 0
        for depth, block_hash in enumerate(block_hashes):
            holders = active & gpu_tier.get(block_hash, 0)
            hopeful = optimistic_tier.get(block_hash)
            if hopeful:
                for worker_id in hopeful:
                    holders |= active & self._bits.get(worker_id, 0)
            cpu_only = active & cpu_tier.get(block_hash, 0) & ~holders
            if cpu_only:
                for bit in _bits_of(cpu_only):
                    cpu[bit] = cpu.get(bit, 0) + 1
                holders |= cpu_only
            if states:
                for bit in _bits_of(holders & states.get(block_hash, 0)):
                    resumable[bit] = depth + 1
            for bit in _bits_of(active & ~holders):
                run[bit] = depth
            active = holders
            if not active:
                break
        else:
            depth = len(block_hashes)
        for bit in _bits_of(active):
            run[bit] = depth
        result = {}
        for worker_id, bit in bits.items():
            matched, on_cpu = run.get(bit, 0), cpu.get(bit, 0)
            result[worker_id] = PrefixMatch(matched - on_cpu, on_cpu, resumable.get(bit, 0))
        return result

    def num_blocks(self, worker_id: str) -> int:
        return len(self._worker_blocks.get(worker_id, ()))


def _without_bit(owners: dict[BlockHash, int], block_hash: BlockHash, bit: int) -> None:
    """``block_hash``'s mask in ``owners`` without ``bit``; the entry goes when none is
    left (a tier's, or the state snapshots')."""
    left = owners.get(block_hash, 0) & ~bit
    if left:
        owners[block_hash] = left
    else:
        owners.pop(block_hash, None)


def _bits_of(mask: int) -> Iterator[int]:
    """The set bits of ``mask``, lowest first, each as its own power of two."""
    while mask:
        bit = mask & -mask
        yield bit
        mask ^= bit
