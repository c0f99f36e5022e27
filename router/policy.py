"""Where a request goes: which decode worker, and whether a prefill worker computes its
prompt first (disaggregated) or the decode worker does it itself (local).

Decode workers are scored by load minus prefix overlap:

    score = max(kv_blocks_in_use / kv_blocks_total, num_running / max_running)
            - decode_prefix_weight * cached_tokens / prompt_tokens

Prefill workers by estimated time to first token, in seconds, plus a charge for work that
another worker would not have to do:

    missing = best_cached_tokens - cached_tokens   (what another worker holds, this not)
    cost = (queued_prefill_tokens + uncached_tokens - missing
            + (1 + prefill_recompute_penalty) * missing / uses)
           / prefill_tokens_per_s

over the prefill workers with free blocks for the prompt (their last Stats, less the
prefills sent and not done), where any has; where a CPU-tier hit counts
``cpu_hit_credit`` of a GPU hit, and ``uses`` is the prefix's
recent uses (``router/prefix_demand.py``; the decode worker's bonus is divided by them
too). With one use (a conversation's next turn) the missing part costs its recomputation
plus the penalty. A prefix many requests share is worth recomputing once elsewhere, so
its recomputation, not only the penalty, is spread over its users: held to its workers it
herded every request onto them, and with only the penalty spread, a request still moved
only when a holder's queue was longer than recomputing the prefix alone, so a hot prefix
reached a new worker one long queue at a time (a routing simulation's 20k-token prefix:
TTFT mean 19.9 s, round-robin 10.4 s; spread, 10.9 s). Pure TTFT-greedy placement
moves a request off the worker holding its prefix as soon as that worker's queue is a bit
longer; the recomputation then lengthens every queue, and the conversation's later turns
find their prefix split. The penalty makes a move pay for the work it wastes (see
benchmarks/routing_sim.py for the trade-off on real traces). A prompt whose part the
chosen decode worker does not cache (in either tier) is shorter than ``min_disagg_tokens``
is prefilled locally: moving its KV would cost more than computing it. Torch-free, no
I/O: the router feeds it snapshots (``WorkerLoad``) and the prefix index's matches.

A hybrid model's worker resumes a prompt only where it caches a state snapshot, so for
it "held on the decode worker" is the part of the match that ends at one
(``PrefixMatch.resumable_blocks``): a decode worker holds a pulled prompt's KV but not the
snapshot at its end (that stays on the prefill worker), and prefilling an exact repeat
"locally" recomputed it whole inside the decode batch; it now goes to the prefill worker
that resumes it, and the decode worker pulls the states. Scores still count every held
block: the decode worker pulls none it holds, and a prefill worker that holds a shared
prefix without a snapshot makes one there the second time (a branch point,
``engine/kv_cache_manager.py``), so sending it that request is what makes the third hit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from common.config import Role
from common.intmath import cdiv
from common.router_config import RouterConfig
from router.prefix_index import PrefixMatch


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What placement knows of one worker at decision time."""

    worker_id: str
    queued_prefill_tokens: int = 0  # prefill: uncached prompt tokens sent, not yet done
    prefill_tokens_per_s: float = 0.0  # prefill: measured speed (0: unknown)
    num_running: int = 0  # decode: requests in flight
    kv_blocks_in_use: int = 0  # decode: blocks its in-flight requests hold (estimated)
    kv_blocks_total: int = 0
    # prefill: free KV blocks at its last Stats (cached ones included: evictable); None:
    # not known. Blocks held under leases for decode workers are not free.
    kv_blocks_free: int | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    decode_worker: str
    prefill_worker: str | None  # None: prefill locally on the decode worker
    decode_cached_tokens: int
    prefill_cached_tokens: int

    @property
    def disaggregated(self) -> bool:
        return self.prefill_worker is not None


class PlacementPolicy:
    def __init__(
        self, config: RouterConfig, block_size: int, max_running: int, hybrid: bool = False
    ) -> None:
        """``hybrid``: the model has linear-attention layers (resumes at snapshots only)."""
        self.config = config
        self.block_size = block_size
        self.max_running = max(max_running, 1)
        self.hybrid = hybrid
        # Rotates the tie-break between equally good workers; one turn per role, since a
        # shared one stepped twice per disaggregated placement and with two tied workers
        # per role always landed on the same pair. Started at random: routers started
        # alike picked alike, all on one worker, until their Stats told them apart.
        start = random.randrange(1 << 16)
        self._turns = {Role.PREFILL: start, Role.DECODE: start}

    def cached_tokens(self, match: PrefixMatch, num_tokens: int) -> float:
        """Prefill work a worker saves, in tokens (CPU hits at their credit)."""
        tokens = (match.gpu_blocks + self.config.cpu_hit_credit * match.cpu_blocks) * (
            self.block_size
        )
        return min(tokens, num_tokens - 1)

    def decode_score(
        self, load: WorkerLoad, cached: float, num_tokens: int, uses: float = 1.0
    ) -> float:
        kv_fraction = load.kv_blocks_in_use / load.kv_blocks_total if load.kv_blocks_total else 0
        running_fraction = load.num_running / self.max_running
        overlap = cached / max(num_tokens, 1)
        bonus = self.config.decode_prefix_weight * overlap / uses
        return max(kv_fraction, running_fraction) - bonus

    def prefill_cost(
        self,
        load: WorkerLoad,
        cached: float,
        num_tokens: int,
        best_cached: float = 0.0,
        uses: float = 1.0,
    ) -> float:
        rate = load.prefill_tokens_per_s or self.config.default_prefill_tokens_per_s
        missing = best_cached - cached
        spread = (1 + self.config.prefill_recompute_penalty) * missing / uses
        return (load.queued_prefill_tokens + num_tokens - cached - missing + spread) / rate

    def _pick(self, scores: list[tuple[float, str]], role: Role) -> tuple[float, str]:
        best = min(score for score, _ in scores)
        ties = [item for item in scores if item[0] <= best + 1e-9]
        self._turns[role] += 1
        return ties[self._turns[role] % len(ties)]

    def place(
        self,
        num_tokens: int,
        decode: Sequence[WorkerLoad],
        prefill: Sequence[WorkerLoad],
        decode_matches: dict[str, PrefixMatch],
        prefill_matches: dict[str, PrefixMatch],
        decode_confirmed: dict[str, PrefixMatch] | None = None,
        uses: float = 1.0,
    ) -> Placement:
        """Choose workers for a prompt of ``num_tokens``. ``decode`` must not be empty.
        ``uses``: the matched prefix's recent uses (``PrefixDemand.use``).

        Matches may count optimistic entries (blocks just sent somewhere): they steer a
        burst sharing a prefix to the same workers. Whether the decode worker prefills
        the prompt itself, though, takes only ``decode_confirmed`` (what its events
        confirmed; None: the matches): the first request of a burst is still being
        prefilled elsewhere, and the others would recompute the whole prompt there."""
        if not decode:
            raise ValueError("no decode worker available")
        decode_cached = self._cached(decode, decode_matches, num_tokens)
        decode_scores = [
            (self.decode_score(w, decode_cached[w.worker_id], num_tokens, uses), w.worker_id)
            for w in decode
        ]
        _, decode_id = self._pick(decode_scores, Role.DECODE)
        held = (decode_confirmed if decode_confirmed is not None else decode_matches).get(
            decode_id, PrefixMatch()
        )
        # Whole blocks, CPU tier too: its blocks are loaded, not computed, pulled prompt
        # or not (the credit ranks workers; here it sent a prompt held whole in the CPU
        # tier to be recomputed by a prefill worker). A hybrid model's: up to a snapshot.
        held_blocks = held.resumable_blocks if self.hybrid else held.num_blocks
        on_decode = min(held_blocks * self.block_size, num_tokens - 1)
        on_decode = max(on_decode, 0)
        if not prefill or num_tokens - on_decode < self.config.min_disagg_tokens:
            return Placement(decode_id, None, on_decode, 0)
        prefill_cached = self._cached(prefill, prefill_matches, num_tokens)
        best = max(prefill_cached.values())
        # Workers that have the room for the prompt, where some have: one whose pool is
        # full of leased blocks (a decode worker frozen or gone mid-hand-off) looked idle
        # and held its request until a lease expired (30 s) beside an idle worker.
        roomy = [w for w in prefill if self._has_room(w, prefill_matches, num_tokens)]
        prefill_scores = [
            (self.prefill_cost(w, prefill_cached[w.worker_id], num_tokens, best, uses), w.worker_id)
            for w in roomy or prefill
        ]
        _, prefill_id = self._pick(prefill_scores, Role.PREFILL)
        return Placement(decode_id, prefill_id, on_decode, int(prefill_cached[prefill_id]))

    def _has_room(self, load: WorkerLoad, matches: dict[str, PrefixMatch], num_tokens: int) -> bool:
        """Whether ``load``'s free blocks, less those of the prefills sent it and not done,
        hold the blocks of the prompt it does not cache (unknown: yes)."""
        if load.kv_blocks_free is None:
            return True
        held = matches.get(load.worker_id, PrefixMatch())
        needed = cdiv(num_tokens, self.block_size) - held.gpu_blocks
        queued = cdiv(load.queued_prefill_tokens, self.block_size)
        return load.kv_blocks_free - queued >= needed

    def _cached(
        self, workers: Sequence[WorkerLoad], matches: dict[str, PrefixMatch], num_tokens: int
    ) -> dict[str, float]:
        return {
            w.worker_id: self.cached_tokens(matches.get(w.worker_id, PrefixMatch()), num_tokens)
            for w in workers
        }
