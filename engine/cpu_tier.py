"""The CPU offload tier: cached KV blocks evicted from the device pool are copied here
instead of being dropped, and a later prefix hit copies them back instead of recomputing.

    device pool evicts block b (hash h) ──► on_block_evicted: queue (b, h)
    engine, before the step's forward   ──► flush(): gather queued blocks → CPU slots
    scheduler admits a request          ──► lookup(hashes): leading run held here
                                        ──► load(hashes, device blocks): CPU → device
    CPU tier full                       ──► its least recently used block is gone

Copies run on the engine thread, in stream order before the forward pass that would
overwrite an evicted block or read a loaded one, so no block is ever read half-written
and no transfer races an allocation or an abort. On CUDA the CPU buffers are pinned and
the copies are asynchronous to the host. A block of a prompt costs ``bytes_per_block``
of copy where recomputing it costs ``block_size`` tokens of prefill: at ~8 GB/s against
a prefill of tens of thousands of tokens/s the copy is orders of magnitude cheaper.

Under tensor parallelism each rank's blocks hold its own KV heads: rank 0 keeps the tier's
books (which hash sits in which slot) and every rank keeps its slots' bytes in a
``HostBlockCache``; the copies rank 0 makes are repeated on the others through ``mirror``
(in the same order relative to the steps, so the same guarantees hold on every rank).

A hybrid model's state snapshots (``kv_cache_manager.py``: its linear-attention states
after a cached prefix, in ordinary blocks under names of their own) are kept here too:
the device pool hands their blocks over as it evicts them (``on_state_block_evicted``),
and a lookup that finds every block of one loads them into device blocks the request
restores its states from, as it loads KV blocks.

Events: every KV block entering the tier is announced as ``BlockStored(medium=cpu)`` and
every one leaving it as ``BlockRemoved(medium=cpu)`` (no token ids: routers only need
the hashes), so routers credit CPU hits at a discount. Snapshots' blocks are not
announced: they are no KV a router could place a request by.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.config_base import ConfigError
from common.hashing import BlockHash
from common.kv_events import BlockRemoved, BlockStored, KVEvent, Medium
from engine.block_pool import KVBlock
from engine.host_memory import host_memory_bytes
from kernels import reference


@dataclass(slots=True)
class CpuTierStats:
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    evicted_blocks: int = 0  # gone from the CPU tier
    hit_blocks: int = 0  # blocks loaded back instead of recomputed
    load_seconds: float = 0.0


class HostBlockCache:
    """One rank's CPU slots: ``num_slots`` blocks of each of its KV caches' shape (the
    layers' and, on rank 0, a draft model's, whose shape may differ)."""

    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        kv_caches = [reference.as_movable(cache) for cache in kv_caches]  # FP8: bytes
        self.device_caches = kv_caches
        pin = kv_caches[0].is_cuda
        self.cpu_caches = [  # each [num_slots, 2, block_size, H, D]
            torch.empty((num_slots, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin)
            for cache in kv_caches
        ]

    def save(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Device blocks -> CPU slots, done when this returns."""
        device_ids = torch.tensor(list(block_ids), dtype=torch.long)
        slot_ids = torch.tensor(list(slots), dtype=torch.long)
        for device_cache, cpu_cache in zip(self.device_caches, self.cpu_caches, strict=True):
            staging = reference.gather_blocks(device_cache, device_ids)  # [n, 2, bs, H, D]
            # Blocking: index_copy_ runs on the host at once, so an asynchronous copy from
            # a GPU could still be in flight when it reads. Costs little: the engine read
            # the last step's tokens back before scheduling, so the GPU is idle here.
            cpu_cache.index_copy_(0, slot_ids, staging.to("cpu"))

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """CPU slots -> device blocks, in stream order before the next forward."""
        slot_ids = torch.tensor(list(slots), dtype=torch.long)
        device_ids = torch.tensor(list(block_ids), dtype=torch.long)
        for device_cache, cpu_cache in zip(self.device_caches, self.cpu_caches, strict=True):
            staging = cpu_cache.index_select(0, slot_ids)
            reference.scatter_blocks(
                staging.to(device_cache.device, non_blocking=True), device_cache, device_ids
            )


class BlockCopies(Protocol):
    """The other ranks' side of the tier's copies (``engine.parallel.ShardClient``)."""

    def open_host_cache(self, num_slots: int) -> None: ...

    def save(self, block_ids: Sequence[int], slots: Sequence[int]) -> None: ...

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None: ...


# The engine's key; a deployment sets it as offload.cpu_bytes (or a role's override).
_KEY = "engine.cpu_offload_bytes (a deployment's offload.cpu_bytes)"


def _check_host_memory(capacity_bytes: int, kv_caches: list[torch.Tensor], num_ranks: int) -> None:
    """Refuse tiers (with the KV caches, where those are on the host too) larger than the
    memory this process may use; ``num_ranks`` tensor-parallel ranks hold one each. Its
    memory is committed as blocks are saved, so a tier 4x the host's started and would
    have got the worker killed under load, hours in."""
    available = host_memory_bytes()
    if available is None:
        return
    on_host = sum(c.numel() * c.element_size() for c in kv_caches if c.device.type == "cpu")
    if num_ranks * (capacity_bytes + on_host) > available:
        cache = f" beside a {on_host / 2**30:.1f} GiB KV cache" if on_host else ""
        ranks = f" on each of {num_ranks} ranks" if num_ranks > 1 else ""
        raise ConfigError(
            _KEY,
            f"{capacity_bytes / 2**30:.1f} GiB{cache}{ranks} is more than this host's "
            f"memory ({available / 2**30:.1f} GiB, or its container's limit)",
        )


class CpuTier:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],  # the device pool's per-layer caches (a draft's too)
        capacity_bytes: int,
        emit: Callable[[KVEvent], None] | None = None,
        mirror: BlockCopies | None = None,
        num_ranks: int = 1,
    ) -> None:
        """``capacity_bytes`` per rank; ``mirror``: the other ranks' copies, if any (of
        ``num_ranks`` in all, on this host)."""
        self.block_size = kv_caches[0].shape[2]
        self.bytes_per_block = sum(cache[0].numel() * cache.element_size() for cache in kv_caches)
        self.num_blocks = capacity_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ConfigError(_KEY, f"{capacity_bytes} bytes hold no block of "
                                    f"{self.bytes_per_block} bytes (0: no CPU tier)")  # fmt: skip
        _check_host_memory(capacity_bytes, kv_caches, num_ranks)
        self.cache = HostBlockCache(kv_caches, self.num_blocks)
        self._mirror = mirror
        if mirror is not None:
            mirror.open_host_cache(self.num_blocks)
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU → MRU
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._pending: list[tuple[int, BlockHash]] = []  # (device block id, hash) to save
        # Names among the pending and held blocks that are snapshots' (not announced).
        self._state_names: set[BlockHash] = set()
        # Blocks a scheduled load will read: never evicted before that load ran.
        self._reserved: set[BlockHash] = set()
        self._emit = emit or (lambda event: None)
        self.stats = CpuTierStats()

    # ------------------------------------------------------------------ pool observer

    def on_blocks_stored(self, blocks, parent_hash, token_ids, block_size) -> None:
        return None

    def on_block_evicted(self, block: KVBlock, block_hash: BlockHash) -> None:
        """The device pool reuses ``block``; its KV is intact until the next forward."""
        self._pending.append((block.block_id, block_hash))

    def on_state_block_evicted(self, block: KVBlock, name: BlockHash) -> None:
        """The device pool reuses a block of a state snapshot (``BlockPool``'s
        ``on_state_evicted``); kept like a KV block, under its name, but not announced."""
        self._pending.append((block.block_id, name))
        self._state_names.add(name)

    def on_all_cleared(self, block_hashes: Sequence[BlockHash]) -> None:
        self._state_names.intersection_update(self._slots)
        self._pending.clear()

    def on_states_stored(self, follows: Sequence[BlockHash]) -> None:
        return None  # (a snapshot's blocks come through ``on_state_block_evicted``)

    def on_states_removed(self, follows: Sequence[BlockHash]) -> None:
        return None

    # ------------------------------------------------------------------ engine side

    def flush(self) -> None:
        """Copy the blocks evicted since the last flush into the tier. Must run before the
        forward pass that may overwrite them (the engine calls it after scheduling)."""
        evicted, self._pending = self._pending, []
        # Each hash once, at its last eviction: one evicted twice since the last flush
        # took two slots, and the second leaked.
        last = {h: i for i, (_, h) in enumerate(evicted)}
        pending = [(b, h) for i, (b, h) in enumerate(evicted)
                   if last[h] == i and h not in self._slots]  # fmt: skip
        for _, block_hash in evicted:  # (held ones first made recent: no victims below)
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
        if not pending:
            return
        stored: list[BlockHash] = []
        slots: list[int] = []
        device_blocks: list[int] = []
        for block_id, block_hash in reversed(pending):  # the most recent first
            slot = self._take_slot()
            if slot is None:  # every slot is reserved for a load: drop the rest
                break
            slots.append(slot)
            stored.append(block_hash)
            device_blocks.append(block_id)
        for _, block_hash in pending[: len(pending) - len(stored)]:  # (dropped)
            self._state_names.discard(block_hash)
        if not slots:
            return
        if self._mirror is not None:
            self._mirror.save(device_blocks, slots)
        self.cache.save(device_blocks, slots)
        # Recency in eviction order, held and new blocks alike, the last evicted most
        # recent: the device evicts a prompt's end before its start, and a lookup needs
        # the run from the start. The most recent first (as slots were taken) made a
        # prompt's first block the next to go, and the rest of it unreachable (a tier
        # holding 9 of a prompt's blocks found 1); held blocks (a turn's prefix loaded
        # back, spilled again with the turn) made recent before the new ones did the same.
        taken = dict(zip(stored, slots, strict=True))
        for _, block_hash in evicted:
            slot = taken.pop(block_hash, None)
            if slot is not None:
                self._slots[block_hash] = slot
            elif block_hash in self._slots:
                self._slots.move_to_end(block_hash)
        self.stats.offloaded_blocks += len(stored)
        self.stats.offloaded_bytes += len(stored) * self.bytes_per_block
        announced = [block_hash for block_hash in stored if block_hash not in self._state_names]
        if announced:
            self._emit(BlockStored(announced, None, [], self.block_size, Medium.CPU))

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h in self._slots if h not in self._reserved), None)
        if victim is None:
            return None
        slot = self._slots.pop(victim)
        self.stats.evicted_blocks += 1
        if victim in self._state_names:
            self._state_names.discard(victim)
        else:
            self._emit(BlockRemoved([victim], Medium.CPU))
        return slot

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading ``block_hashes`` the tier holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._slots:
                break
            count += 1
        return count

    def reserve(self, block_hashes: Sequence[BlockHash]) -> None:
        """Keep these blocks until ``load`` reads them (the scheduler committed to it).
        Used now: the first block the most recent (a run is found from its start)."""
        for block_hash in reversed(block_hashes):
            self._slots.move_to_end(block_hash)
            self._reserved.add(block_hash)

    def load(self, block_hashes: Sequence[BlockHash], device_block_ids: Sequence[int]) -> None:
        """Copy held blocks into device blocks (in stream order before the next forward).
        Call after ``flush``: the target blocks may be ones just evicted."""
        if not block_hashes:
            return
        start = time.perf_counter()
        slots = [self._slots[block_hash] for block_hash in block_hashes]
        for block_hash in reversed(block_hashes):  # (as ``reserve``)
            self._slots.move_to_end(block_hash)
        if self._mirror is not None:
            self._mirror.load(slots, device_block_ids)
        self.cache.load(slots, device_block_ids)
        self._reserved.difference_update(block_hashes)
        self.stats.hit_blocks += len(slots)
        self.stats.load_seconds += time.perf_counter() - start

    @property
    def num_used_blocks(self) -> int:
        return len(self._slots)

    def leak_report(self) -> list[str]:
        problems = []
        if len(self._slots) + len(self._free_slots) != self.num_blocks:
            problems.append(
                f"CPU tier: {len(self._slots)} held + {len(self._free_slots)} free slots "
                f"!= {self.num_blocks}"
            )
        if len(set(self._slots.values())) != len(self._slots):
            problems.append("CPU tier: a slot holds two blocks")
        if self._pending:
            problems.append(f"CPU tier: {len(self._pending)} evicted blocks not flushed")
        if self._reserved:
            problems.append(f"CPU tier: {len(self._reserved)} blocks reserved for no load")
        if not self._state_names <= self._slots.keys():
            problems.append("CPU tier: a snapshot's block is named but not held")
        return problems
