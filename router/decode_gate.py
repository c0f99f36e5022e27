"""Backpressure between prefill and decode: a sequence starts (its prefill, on a prefill
worker or on the decode worker itself) only when its decode worker can take it soon.

A prefill worker holds a finished prompt's KV under a lease until the decode worker pulls
it, and a decode worker pulls only when it admits the sequence (a batch slot and free
blocks). With the decode side behind, prefilling ahead of it fills the prefill workers'
caches with leases nobody can pull yet: new prompts wait for blocks there, and leases that
expire unpulled make the decode worker recompute their prompts, on the side that is
already the bottleneck (an overload audit saw prefill idle for 30 s stretches with 57 of
64 blocks leased, and 6 of 30 prompts recomputed). So the router keeps such sequences
itself, in line per decode worker, until fewer than its limit are ahead. The line goes by
the requests' priority (lower first, all 0 under FCFS), then by arrival.
Sequences the decode worker prefills itself stand in the same line: they pin no lease,
but if they passed it, a burst of short prompts would overtake long ones that came first.

"Ahead" is counted in sequences and in KV blocks (``Ahead``): a sequence limit alone lets
a long-context workload (the Mooncake traces' prompts average 12k-15k tokens) queue far
more KV than the decode worker or the prefill workers' leases can hold, and the pile-up
above returns.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from router.once import once

# How often a waiting sequence looks again without being woken: the pool may have dropped
# its worker, or another router's sequences may have left it.
RECHECK_S = 1.0


class DecodeGate:
    """The sequences waiting for room on one decode worker, by (priority, arrival). Room is
    the caller's predicate; whoever frees room calls ``wake``, which wakes the first waiter
    only, and each one let through wakes the next. A sequence that arrives with a smaller
    priority value than the head's goes first, and through at once if there is room."""

    def __init__(self) -> None:
        # (priority, arrival number, the waiter's event), head first.
        self._waiters: list[tuple[int, int, asyncio.Event]] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    async def enter(self, has_room: Callable[[], bool], priority: int = 0) -> None:
        """Return once this sequence is first in line and ``has_room()``; at once if
        nobody waits and there is room. Cancellation leaves the line."""
        if not self._waiters and has_room():
            return
        turn = asyncio.Event()
        entry = (priority, next(self._arrivals), turn)
        bisect.insort(self._waiters, entry, key=lambda waiter: waiter[:2])
        try:  # passing the head, it looks for room at once (the head waits for a wake)
            while not (self._waiters[0] is entry and has_room()):
                turn.clear()
                # ``asyncio.timeout``, not ``wait_for``: on Python 3.11 a cancel that lands
                # as the turn comes was swallowed by wait_for, and the sequence went through
                # to decode to its end for a client that had left.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RECHECK_S):
                        await turn.wait()
        finally:
            self._waiters.remove(entry)
            self.wake()  # the next one may fit too, or this one left the head of the line

    def wake(self) -> None:
        if self._waiters:
            self._waiters[0][2].set()


class Ahead:
    """The router's sequences that passed a decode worker's gate and have not ended (in
    prefill for it, in its queue or batch), and the KV blocks their prompts take there.

    Blocks are counted as the decode worker's prefix cache stores them: a full block once
    however many sequences share it (by chain hash), a partial last block per sequence.
    Tokens generated later are not counted: the bound is on the prompts' KV, which is what
    waits in prefill leases; growth the decode batch cannot hold it preempts, as it would
    anyway.
    """

    def __init__(self) -> None:
        self.num_seqs = 0
        self._shared: Counter[Hashable] = Counter()  # full blocks: sequences holding each
        self._num_partial = 0
        self._priorities: Counter[int] = Counter()  # sequences of each priority value

    def num_seqs_not_after(self, priority: int) -> int:
        """The sequences ahead that a sequence of ``priority`` cannot preempt: those of the
        same or a smaller value (all of them under FCFS, where every value is 0)."""
        return sum(count for value, count in self._priorities.items() if value <= priority)

    @property
    def num_blocks(self) -> int:
        return len(self._shared) + self._num_partial

    def num_blocks_with(self, block_hashes: Sequence[Hashable], num_blocks: int) -> int:
        """``num_blocks`` once a prompt of ``num_blocks`` blocks, whose full ones hash to
        ``block_hashes``, joins."""
        new = sum(1 for h in block_hashes if h not in self._shared)
        return self.num_blocks + new + num_blocks - len(block_hashes)

    def join(
        self, block_hashes: Sequence[Hashable], num_blocks: int, priority: int = 0
    ) -> Callable[[], None]:
        """Count one sequence until the returned call (idempotent) ends that."""
        hashes = list(block_hashes)
        num_partial = num_blocks - len(hashes)
        self.num_seqs += 1
        self._shared.update(hashes)
        self._num_partial += num_partial
        self._priorities[priority] += 1

        def leave() -> None:
            self.num_seqs -= 1
            self._priorities[priority] -= 1
            if not self._priorities[priority]:
                del self._priorities[priority]
            self._shared.subtract(hashes)
            for h in hashes:
                if self._shared[h] <= 0:
                    self._shared.pop(h, None)
            self._num_partial -= num_partial

        return once(leave)
