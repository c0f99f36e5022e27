"""Which blocks each request holds, prefix-cache lookups, and slot allocation. Torch-free.

A request's blocks cover its tokens in order: token ``i`` lives in block
``blocks[i // block_size]`` at offset ``i % block_size``. Full blocks are hashed (see
``common/hashing.py``) and registered in the prefix cache as soon as their tokens are
scheduled; the KV lands in the same engine step, before any other request can read it.

A hybrid model (``num_state_blocks``: its linear-attention states take that many blocks,
``engine/linear_state.py``) can reuse a cached prefix only with the states after it, so
the cache also keeps *state snapshots*: at ``snapshot_boundary`` (the last block boundary
before a prompt's last token) a request's states are copied into blocks of their own,
registered after the step that wrote them (``cache_snapshot``). A lookup then takes the
longest cached prefix that ends where a snapshot is (``state_hit``), and the request
starts from a copy of it (its blocks held until that step has run: ``hold_restore``).
Outside decode workers, a request's decode also keeps one *rolling* snapshot, rewritten
at each block boundary it reaches, so what it generated is covered too (a chat's next
turn starts from the end of the last answer's last full block).

With a secondary tier (the CPU tier) a hybrid model's lookup runs over both: the cached
prefix is the device's leading blocks then the tier's, and its snapshot may be in either.
The device pool hands snapshots' blocks to the tier as it evicts them; one found there is
loaded into blocks the request takes for it (``restoring``, registered under the
snapshot's names at once, so other requests find it on the device from then on) before
the forward pass of the step that restores the request's states from them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.hashing import BlockHash, hash_blocks, state_block_hashes
from common.intmath import cdiv
from engine.block_pool import BlockPool, BlockPoolObserver, KVBlock
from engine.request import Request


@dataclass(slots=True)
class _Snapshot:
    """A hybrid request's state snapshot after its first ``boundary`` tokens: the hash of
    the block it follows (what KV events name it by), its names, the blocks the request
    holds (those of one it made, until it lets them go; none of one it started from), and
    whether it is the one its decode rewrites at each block boundary (``rolling``)."""

    boundary: int
    follows: BlockHash
    names: list[BlockHash]
    blocks: list[KVBlock]
    rolling: bool = False


@dataclass(slots=True)
class StateHit:
    """A hybrid request's cached prefix (``KVCacheManager.state_hit``): its device blocks,
    the secondary tier's blocks after them, and the device blocks of the state snapshot
    after both (empty when none is cached, or when it is loaded from the tier)."""

    hits: list[KVBlock]
    loaded: list[BlockHash]
    restore: list[KVBlock]


class SecondaryTier(Protocol):
    """A second place cached blocks may live (the CPU tier): torch-free view for lookups."""

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int: ...

    def reserve(self, block_hashes: Sequence[BlockHash]) -> None: ...

    def on_state_block_evicted(self, block: KVBlock, name: BlockHash) -> None: ...


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        observers: Iterable[BlockPoolObserver] = (),
        secondary: SecondaryTier | None = None,
        num_state_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_state_blocks = num_state_blocks if enable_caching else 0
        self.secondary = secondary if enable_caching else None
        self.enable_caching = enable_caching
        on_state_evicted = None
        if self.secondary is not None and self.num_state_blocks:
            on_state_evicted = self.secondary.on_state_block_evicted
        self.pool = BlockPool(num_blocks, enable_caching, observers, on_state_evicted)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # The same blocks' ids, kept alongside: read every step (block_ids_view).
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Hybrid models: the snapshot blocks a request starts from (held until its first
        # step has copied them), and those a request's step writes (until it has).
        self.restoring: dict[str, list[KVBlock]] = {}
        self.snapshotting: dict[str, _Snapshot] = {}
        # ... and the names of the snapshot a request starts from that the secondary
        # tier holds (``state_hit``): ``allocate_slots`` takes blocks for it (then in
        # ``restoring``), which ``take_snapshot_load`` orders loaded.
        self.snapshot_loads: dict[str, _Snapshot] = {}
        # ... and the snapshots each request started from or made. Its own are held as
        # long as its blocks are (a snapshot freed at once was the first thing evicted
        # while the request ran, long before the prefix it needs); freeing the request
        # frees or refreshes them right before the blocks they follow.
        self.snapshots_of: dict[str, list[_Snapshot]] = {}
        # ... and where a request's cached KV ran past the snapshot it started from: its
        # states are snapshotted there too (``state_hit``).
        self.branch_points: dict[str, int] = {}
        # Blocks a failed pull's transfer may still write (a late one), by transfer id:
        # one reference each, so no one allocates them until ``release_quarantine``.
        self.quarantined: dict[str, list[KVBlock]] = {}
        # Prefix-cache statistics, in tokens.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_secondary_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its tokens."""
        num_full_blocks = request.num_tokens // self.block_size
        num_hashed = len(request.block_hashes)
        if num_full_blocks <= num_hashed:
            return
        bs = self.block_size
        request.block_hashes.extend(
            hash_blocks(
                request.token_ids_between(num_hashed * bs, num_full_blocks * bs),
                bs,
                salt=request.prefix_salt,
                parent_hash=request.block_hashes[-1] if num_hashed else None,
                images=request.image_spans,
                first_position=num_hashed * bs,
            )
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request: (blocks, number of tokens they hold).

        At least one token is always left to compute, because the last token's hidden state
        is needed to sample the next one.
        """
        if not self.enable_caching:
            return [], 0
        hits = self._cached_run(request, 0)
        return hits, len(hits) * self.block_size

    def get_next_cached_blocks(self, request: Request) -> list[KVBlock]:
        """Cached blocks right after what a running request has computed: blocks that
        another request sharing its prompt computed (or scheduled this step) since this
        one was admitted. Taken instead of computed, they end the lockstep in which
        requests with one prompt, admitted while its first was still being prefilled in
        chunks, each computed all of it. Only for a request holding just its computed
        blocks, all full (one whose chunk ended mid-block fills its own block first:
        ``tokens_to_cached_block``), and never the block of the last token (its hidden
        state is needed to sample)."""
        first, rest = divmod(request.num_computed_tokens, self.block_size)
        if not self.enable_caching or rest or self.num_state_blocks:  # (no states there)
            return []
        if len(self.req_to_blocks.get(request.request_id, ())) != first:
            return []
        return self._cached_run(request, first)

    def _cached_run(self, request: Request, first: int) -> list[KVBlock]:
        """The cached blocks of the request's full blocks from index ``first`` on, up to
        the first one not cached and short of the last token's block (``_max_hit_blocks``)."""
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[first : self._max_hit_blocks(request)]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def tokens_to_cached_block(self, request: Request) -> int | None:
        """For a running request whose computed tokens end mid-block (a chunk cut by the
        step's budget, or a chunk size off the block size): the tokens that fill its
        partial block, when the block after it is cached. Its chunk then stops there, and
        the next step takes the cached blocks (``get_next_cached_blocks``) instead of
        computing past the boundary. None when there is nothing to take."""
        first, rest = divmod(request.num_computed_tokens, self.block_size)
        if not self.enable_caching or not rest or self.num_state_blocks:
            return None
        if len(self.req_to_blocks.get(request.request_id, ())) != first + 1:
            return None
        following = first + 1
        if following >= self._max_hit_blocks(request):
            return None
        if self.pool.get_cached_block(request.block_hashes[following]) is None:
            return None
        return self.block_size - rest

    # -- hybrid models' state snapshots ---------------------------------------------------

    def state_hit(self, request: Request, hits: list[KVBlock]) -> StateHit:
        """The longest run of a new request's cached prefix (``hits`` on the device, then
        the secondary tier's blocks) after which a state snapshot is cached, on the
        device or in the tier (then noted in ``snapshot_loads``); nothing if none is.

        Where the cached prefix runs past that snapshot, its end becomes the request's
        *branch point*: a prefix it shares with an earlier request (a system prompt, a document,
        a conversation whose rolling snapshot was evicted) that no snapshot covers. The
        request recomputes it and snapshots its states there too (``snapshot_boundary``),
        so the next request sharing it starts from that snapshot: the second request
        with a system prompt recomputes it, the third does not. A snapshot costs
        ``num_state_blocks`` blocks, so they are kept only where sharing was seen, not
        at every block (SGLang keeps them at its radix tree's branches for the same
        reason)."""
        request_id = request.request_id
        self.snapshots_of.pop(request_id, None)  # (an earlier lookup's, while it waited)
        self.branch_points.pop(request_id, None)
        self.snapshot_loads.pop(request_id, None)
        if cdiv(request.num_tokens, self.block_size) + self.num_state_blocks > self.pool.num_blocks:
            # Restoring holds the snapshot's blocks beside the prompt's until the step
            # copies them: a pool too small for both never admitted the request (nothing
            # else ran to evict the snapshot, which every failed try kept warm), and under
            # FCFS nothing behind it either. Recompute: a lone request always fits.
            return StateHit([], [], [])
        loaded = self.get_secondary_hits(request, len(hits))
        num_cached = len(hits) + len(loaded)
        num_hits, blocks = 0, []
        for length in range(num_cached, 0, -1):
            snapshot = self._snapshot(request, length * self.block_size)
            cached = self._cached_snapshot(snapshot.names)
            if cached is None:
                if self.secondary is None or self.secondary.lookup(snapshot.names) < len(
                    snapshot.names
                ):
                    continue
                self.snapshot_loads[request_id] = snapshot
            num_hits, blocks = length, cached or []
            self.snapshots_of[request_id] = [snapshot]
            break
        if num_hits < num_cached < self._max_hit_blocks(request):
            self.branch_points[request_id] = num_cached * self.block_size
        return StateHit(hits[:num_hits], loaded[: max(num_hits - len(hits), 0)], blocks)

    def snapshot_boundary(self, request: Request, num_computed: int) -> int:
        """The next place after ``num_computed`` tokens where a hybrid request's states
        are snapshotted (a block boundary; 0, none, for other models): its branch point
        (``state_hit``), then the last block boundary before its last token (what a
        request repeating its tokens, or continuing them as a chat's next turn, can hit:
        ``_max_hit_blocks``). The scheduler ends a chunk there unless ``has_snapshot``
        (arithmetic only: it is asked for every request every step)."""
        if not self.num_state_blocks:
            return 0
        branch = self.branch_points.get(request.request_id, 0)
        if num_computed < branch:
            return branch
        return self._max_hit_blocks(request) * self.block_size

    def has_snapshot(self, request: Request, boundary: int) -> bool:
        """Whether the snapshot after ``request``'s first ``boundary`` tokens is cached."""
        return self._cached_snapshot(self._snapshot(request, boundary).names) is not None

    def _cached_snapshot(self, names: list[BlockHash]) -> list[KVBlock] | None:
        """The blocks of the snapshot named ``names``; None unless all are cached."""
        blocks = [self.pool.get_state_block(name) for name in names]
        return None if None in blocks else blocks  # type: ignore[return-value]

    def take_snapshot_blocks(
        self, request: Request, boundary: int, rolling: bool = False
    ) -> list[int] | None:
        """Blocks for the snapshot of ``request``'s states after ``boundary`` tokens,
        which its step now computes to (their ids: the step copies the states into them);
        None when the pool has no room to spare (no snapshot, nothing evicted for one
        beyond free blocks). ``rolling``: a decode's block boundary, whose snapshot takes
        the place of the request's last such one, in its blocks (renamed now, so no
        lookup finds them until the step has written them: one that found them in this
        step copies them before the step writes)."""
        blocks = None
        previous = self._rolling(request.request_id) if rolling else None
        if (previous is None or not previous.blocks) and (
            self.pool.num_free_blocks < self.num_state_blocks
        ):
            return None  # (a let-go previous one stays the request's: refreshed at its free)
        if previous is not None:  # replaced: its blocks reused, or (let go) left cached
            self.snapshots_of[request.request_id].remove(previous)
            if previous.blocks:
                self.pool.uncache_state_blocks(previous.names)
                blocks = previous.blocks
        if blocks is None:
            blocks = self.pool.allocate(self.num_state_blocks)
        snapshot = self._snapshot(request, boundary, blocks, rolling)
        self.snapshotting[request.request_id] = snapshot
        return [block.block_id for block in blocks]

    def cache_snapshot(self, request_id: str) -> None:
        """The step that wrote ``request_id``'s snapshot ran: register it, held by the
        request until it frees its blocks; or, when an equal one was cached meanwhile,
        free its blocks as plain ones."""
        snapshot = self.snapshotting.pop(request_id)
        if not self.pool.cache_state_blocks(snapshot.blocks, snapshot.names, snapshot.follows):
            self.pool.free(snapshot.blocks)
            snapshot.blocks = []
        self.snapshots_of.setdefault(request_id, []).append(snapshot)

    def release_held_snapshots(self) -> bool:
        """Let go of the snapshots running requests hold (they stay cached, first in
        line for eviction): a step short of blocks takes them before it preempts or
        turns an admission away. Returns whether any were held."""
        released = False
        for snapshots in self.snapshots_of.values():
            for snapshot in snapshots:
                if snapshot.blocks:
                    self.pool.free(snapshot.blocks)
                    snapshot.blocks = []
                    released = True
        return released

    @property
    def num_held_snapshot_blocks(self) -> int:
        """Blocks running requests hold for their snapshots: in use, but let go before
        any request is preempted or turned away (``release_held_snapshots``)."""
        return sum(len(s.blocks) for snapshots in self.snapshots_of.values() for s in snapshots)

    def _rolling(self, request_id: str) -> _Snapshot | None:
        return next((s for s in self.snapshots_of.get(request_id, ()) if s.rolling), None)

    def hold_restore(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Keep a snapshot that ``request_id`` starts from until its step copied it
        (a no-op for none)."""
        if blocks:
            self.pool.touch(blocks)
            self.restoring[request_id] = blocks

    def take_snapshot_load(self, request_id: str) -> tuple[list[BlockHash], list[int]] | None:
        """For a request just given its blocks whose snapshot the secondary tier holds:
        (the snapshot's names, the device blocks to load it into, which it restores its
        states from); None for any other."""
        snapshot = self.snapshot_loads.pop(request_id, None)
        if snapshot is None:
            return None
        return snapshot.names, [block.block_id for block in self.restoring[request_id]]

    def release_restore(self, request_id: str) -> None:
        """Let go of the snapshot a request started from (its copy is made); a no-op
        if it holds none."""
        self.pool.free(self.restoring.pop(request_id, ()))

    def _snapshot(
        self,
        request: Request,
        num_tokens: int,
        blocks: list[KVBlock] | None = None,
        rolling: bool = False,
    ) -> _Snapshot:
        """The snapshot after the request's first ``num_tokens`` (a block boundary): its
        names derived from the name of the block that ends there."""
        follows = request.block_hashes[num_tokens // self.block_size - 1]
        names = state_block_hashes(follows, self.num_state_blocks)
        return _Snapshot(num_tokens, follows, names, blocks or [], rolling)

    def _max_hit_blocks(self, request: Request) -> int:
        """0 for a request scoring its prompt: every prompt token's logits are needed."""
        if request.scores_prompt:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int,
                      num_secondary_hit_tokens: int = 0) -> None:  # fmt: skip
        """Count a lookup into the hit-rate stats, once per request: a request that
        waits looks its prefix up again every step, one preempted or whose pull failed
        looks it up again when readmitted (finding its own blocks), and counting those
        would make the hit rate meaningless under memory pressure or transfer failures."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens
        self.num_secondary_hit_tokens += num_secondary_hit_tokens

    def get_secondary_hits(self, request: Request, num_device_hits: int) -> list[BlockHash]:
        """Hashes of the blocks right after the device hits that the secondary tier holds
        (again leaving at least one token to compute)."""
        if self.secondary is None:
            return []
        max_hit_blocks = self._max_hit_blocks(request)
        candidates = request.block_hashes[num_device_hits:max_hit_blocks]
        return candidates[: self.secondary.lookup(candidates)]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        cache: bool = True,
    ) -> bool:
        """Give ``request`` room for ``num_new_tokens`` more tokens after what it has computed
        (plus ``new_computed_blocks`` found in the cache). False, with nothing changed, if the
        pool cannot hold them.

        ``cache=False`` leaves the new full blocks out of the prefix cache: their KV arrives
        later from another worker, and ``cache_full_blocks`` registers them once it has."""
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        req_block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        num_tokens_after, num_new_blocks = self._growth(request, num_new_tokens,
                                                        new_computed_blocks)  # fmt: skip
        # Cache hits that sit in the free queue stop being allocatable once we take them.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
                del self.req_to_block_ids[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        restoring = self._num_loading_blocks(request)
        new_blocks = new_computed_blocks
        if num_new_blocks > restoring:
            new_blocks = new_computed_blocks + self.pool.allocate(num_new_blocks - restoring)
        if restoring:  # a snapshot the secondary tier holds: blocks to load it into
            blocks = self.pool.allocate(restoring)
            loading = self.snapshot_loads[request.request_id]
            self.pool.cache_state_blocks(blocks, loading.names, loading.follows)
            self.restoring[request.request_id] = blocks
        req_blocks.extend(new_blocks)
        req_block_ids.extend(block.block_id for block in new_blocks)
        if cache:
            self.cache_full_blocks(request, num_tokens_after)
        return True

    def _growth(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock]
    ) -> tuple[int, int]:
        """(tokens the request will hold, blocks to take from the pool) for
        ``allocate_slots(request, num_new_tokens, new_computed_blocks)``."""
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_tokens_after = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
        )
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - num_held
        return num_tokens_after, (
            num_new_blocks - len(new_computed_blocks) + self._num_loading_blocks(request)
        )

    def _num_loading_blocks(self, request: Request) -> int:
        """Blocks a request's next allocation takes for the tier's snapshot it starts
        from (``snapshot_loads``), beside its KV's."""
        request_id = request.request_id
        loading = request_id in self.snapshot_loads and request_id not in self.restoring
        return self.num_state_blocks if loading else 0

    def fits_after_freeing(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock],
        freed: list[Request],
    ) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens, new_computed_blocks)`` would
        succeed once every request of ``freed`` has freed its blocks: a block comes free
        when those requests hold all its references."""
        refs = Counter(block for other in freed for block in self.req_to_blocks.get(
            other.request_id, ()))  # fmt: skip
        num_freed = sum(1 for block, count in refs.items() if block.ref_cnt == count)
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == refs.get(b, 0))
        _, num_new_blocks = self._growth(request, num_new_tokens, new_computed_blocks)
        return num_new_blocks <= self.pool.num_free_blocks + num_freed - num_free_hits

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail is evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.release_restore(request.request_id)  # (its step never ran)
        self.branch_points.pop(request.request_id, None)
        self.snapshot_loads.pop(request.request_id, None)
        unwritten = self.snapshotting.pop(request.request_id, None)
        if unwritten is not None:  # never registered (a rolling one's were renamed)
            self.pool.free(unwritten.blocks)
        # A hybrid request's snapshots go back in the LRU right before the blocks they
        # follow: evicted after the blocks past them, before the prefix they need.
        end = len(blocks)
        snapshots = self.snapshots_of.pop(request.request_id, [])
        for snapshot in sorted(snapshots, key=lambda snapshot: -snapshot.boundary):
            first = min(snapshot.boundary // self.block_size, end)
            self.pool.free(reversed(blocks[first:end]))
            end = first
            if snapshot.blocks:
                self.pool.free(snapshot.blocks)
            else:  # one it started from, or let go: others may hold it
                cached = [self.pool.get_state_block(name) for name in snapshot.names]
                self.pool.refresh(block for block in cached if block is not None)
        self.pool.free(reversed(blocks[:end]))

    def quarantine(self, request_id: str, first: int, last: int, transfer_id: str) -> None:
        """Keep the request's blocks ``first .. last`` (those its failed pull may still
        write) out of circulation under ``transfer_id``: a reference of their own, so
        freeing the request (as it then is) leaves them allocated, and no prefix-cache
        entry can name them (pulled blocks are cached only once their pull is done)."""
        assert transfer_id not in self.quarantined, transfer_id
        blocks = self.req_to_blocks[request_id][first:last]
        assert all(block.block_hash is None for block in blocks)
        self.pool.touch(blocks)
        self.quarantined[transfer_id] = blocks

    def release_quarantine(self, transfer_id: str) -> int:
        """Nothing writes the blocks quarantined under ``transfer_id`` any more: back to
        the free pool (unless another reference holds them). Returns how many there were
        (0 for an unknown id)."""
        blocks = self.quarantined.pop(transfer_id, [])
        self.pool.free(reversed(blocks))
        return len(blocks)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.quarantined.values())

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in token order."""
        return list(self.req_to_block_ids.get(request_id, ()))

    def block_ids_view(self, request_id: str) -> list[int]:
        """The request's block ids without a copy, for a step's batch: the manager's own
        list, which only grows while the request holds its blocks and is replaced by a
        new list once it frees them (``engine.block_table`` relies on both). Callers must
        not change it, nor keep it past the step."""
        return self.req_to_block_ids.get(request_id) or []

    def leak_report(self) -> list[str]:
        problems = [f"request {rid} still holds blocks" for rid in self.req_to_blocks]
        problems += [f"request {rid} still holds a snapshot to restore"
                     for rid in self.restoring]  # fmt: skip
        problems += [f"request {rid} still holds snapshot blocks"
                     for rid in {*self.snapshotting, *self.snapshots_of}]  # fmt: skip
        problems += [f"request {rid} still has a branch point" for rid in self.branch_points]
        problems += [f"request {rid} still has a snapshot to load"
                     for rid in self.snapshot_loads]  # fmt: skip
        problems += [f"{len(blocks)} blocks quarantined for late pull {tid}"
                     for tid, blocks in self.quarantined.items()]  # fmt: skip
        return problems + self.pool.leak_report()

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        req_blocks = self.req_to_blocks[request.request_id]
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        bs = self.block_size
        self.pool.cache_blocks(
            req_blocks[num_cached:num_full],
            request.block_hashes[num_cached:num_full],
            request.block_hashes[num_cached - 1] if num_cached else None,
            request.token_ids_between(num_cached * bs, num_full * bs),
            bs,
        )
        self.num_cached_blocks[request.request_id] = num_full
