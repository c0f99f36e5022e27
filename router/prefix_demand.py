"""How many requests a prefix served lately: what moving it to another worker is spread
over. Torch-free.

Placement charges a worker that would recompute a prefix another worker caches
(``router/policy.py``). For a conversation's next turn that charge is right: the turn is
the prefix's one user, and recomputing it elsewhere is work wasted. For a prefix shared
by many requests (a long system prompt, a few-shot header) it is not: recomputed once on
another worker, it serves every later request sent there. Charged in full every time, it
kept such requests on the workers holding the prefix until their queues were (1 +
penalty) x the prefix longer than an idle worker's: a routing simulation (2026-12-01,
4P4D, a 20k-token prefix at 12 requests/s) put 1,500 requests on 2 of 4 prefill workers
(TTFT p50 5.7 s; 0.16 s spread). So the charge (and the decode worker's bonus for
holding the prefix, which starved a decode worker alike) is divided by the prefix's
recent uses.

A prefix is named by the deepest block any worker matched (its hash covers the whole
prefix). Its uses decay exponentially with ``window_s``; at most ``capacity`` prefixes
are kept, the least recently used dropped first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from common.hashing import BlockHash
from router.prefix_index import PrefixMatch


class PrefixDemand:
    def __init__(
        self,
        window_s: float,
        capacity: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``window_s``: the decay time of a prefix's uses (0: every prefix counts one
        use, the charge undivided)."""
        self.window_s = window_s
        self.capacity = capacity
        self.clock = clock
        # Prefix (its deepest block's hash) → (decayed uses, when last counted). A dict
        # in use order: a use re-inserts its key at the end.
        self._uses: dict[BlockHash, tuple[float, float]] = {}

    def use(self, block_hash: BlockHash, count: bool = True) -> float:
        """Count one more use of the prefix ending at ``block_hash``; its recent uses,
        this one included (>= 1). ``count`` False: its recent uses, none counted (at
        least 1)."""
        if self.window_s <= 0:
            return 1.0
        now = self.clock()
        if not count:
            uses, last = self._uses.get(block_hash, (0.0, now))
            return max(uses * math.exp(-(now - last) / self.window_s), 1.0)
        uses, last = self._uses.pop(block_hash, (0.0, now))
        uses = uses * math.exp(-(now - last) / self.window_s) + 1.0
        self._uses[block_hash] = (uses, now)
        if len(self._uses) > self.capacity:
            del self._uses[next(iter(self._uses))]
        return uses

    def use_deepest(
        self, block_hashes: Sequence[BlockHash], matches: Iterable[PrefixMatch], count: bool = True
    ) -> float:
        """``use`` of the deepest prefix of ``block_hashes`` a worker matched (1: none)."""
        deepest = max((match.num_blocks for match in matches), default=0)
        return self.use(block_hashes[deepest - 1], count) if deepest else 1.0

    def __len__(self) -> int:
        return len(self._uses)
