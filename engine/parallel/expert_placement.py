"""Which rank holds which routed expert, under expert parallelism (torch-free).

A *placement* lists the logical expert held by each physical expert slot, all ranks'
slots in rank order: ``N`` ranks of ``S = (E + R) / N`` slots each, for ``E`` experts and
``R`` redundant slots (``engine.num_redundant_experts``). Every expert has at least one
slot; a popular one may have several (its *replicas*), on different ranks, and the pairs
(token, expert) routed to it are dealt out among them (``moe.SparseMoe``).

    placement  | 0 1 2 7 4 | 5 6 3 0 1 |    E = 8, R = 2, N = 2: the loaded placement
                   rank 0      rank 1       (experts 0 and 1 on both ranks: for equal
                                            loads, each rank runs 4 experts' worth)

``rebalance`` is DeepSeek's EPLB over one layer's measured load (routed pairs per
expert): the ``R`` copies go one by one to the expert whose pairs per copy are highest;
then the copies, heaviest first, each go to the least-loaded rank that has room and no
copy of that expert yet. Within a rank, an expert it already held keeps its slot, so
only experts that change rank move (``moves``). Its measure of success is ``imbalance``:
the busiest rank's pairs over the mean rank's, summed over layers (1.0 is perfect
balance), since a step of an expert-parallel layer lasts as long as its busiest rank.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

Placement = tuple[int, ...]  # physical slot -> logical expert, every rank's slots in order


@functools.cache  # the loader asks once per expert parameter; with copies it packs anew
def loaded_placement(num_experts: int, num_redundant_experts: int, num_ranks: int) -> Placement:
    """The placement weights load into: rank r's contiguous range of experts, and with
    copies, ``rebalance`` for equal loads (copies of experts ``0 .. R-1``, packed so that
    every rank runs an equal share of equally loaded experts)."""
    contiguous = tuple(p % num_experts for p in range(num_experts + num_redundant_experts))
    if not num_redundant_experts:
        return contiguous
    return rebalance([1.0] * num_experts, contiguous, num_ranks)


def rank_slots(placement: Placement, rank: int, num_ranks: int) -> Placement:
    """The experts in ``rank``'s slots, in slot order."""
    per_rank = len(placement) // num_ranks
    return placement[rank * per_rank : (rank + 1) * per_rank]


def replica_table(
    placement: Placement, num_experts: int, rank: int, num_ranks: int
) -> tuple[list[list[int]], list[int]]:
    """For ``rank``: each expert's replicas as local slot indices (``S``, one past the
    last slot, for a replica on another rank), padded with ``S`` to ``R + 1`` columns;
    and each expert's number of replicas. Every rank numbers an expert's replicas in
    physical order, so ranks agree on which replica takes which pair."""
    per_rank = len(placement) // num_ranks
    width = len(placement) - num_experts + 1
    first = rank * per_rank
    slots: list[list[int]] = [[] for _ in range(num_experts)]
    for physical, expert in enumerate(placement):
        local = physical - first
        slots[expert].append(local if 0 <= local < per_rank else per_rank)
    counts = [len(replicas) for replicas in slots]
    if 0 in counts:
        raise ValueError(f"expert {counts.index(0)} has no slot in placement {placement}")
    return [row + [per_rank] * (width - len(row)) for row in slots], counts


def rank_loads(load: Sequence[float], placement: Placement, num_ranks: int) -> list[float]:
    """The pairs each rank runs when each expert's ``load`` is shared evenly by its
    replicas."""
    replicas = Counter(placement)
    per_rank = len(placement) // num_ranks
    return [
        sum(load[e] / replicas[e] for e in placement[r * per_rank : (r + 1) * per_rank])
        for r in range(num_ranks)
    ]


def imbalance(
    loads: Sequence[Sequence[float]], placements: Sequence[Placement], num_ranks: int
) -> float:
    """How much longer the layers' expert work takes than if every rank had an equal
    share: the sum over layers of the busiest rank's pairs over the sum of the mean
    rank's (each layer waits for its busiest rank). 1.0 is perfect, and what nothing
    routed counts as."""
    busiest = mean = 0.0
    for load, placement in zip(loads, placements, strict=True):
        per_rank = rank_loads(load, placement, num_ranks)
        busiest += max(per_rank)
        mean += sum(per_rank) / num_ranks
    return busiest / mean if mean > 0 else 1.0


def rebalance(load: Sequence[float], current: Placement, num_ranks: int) -> Placement:
    """A placement of ``current``'s shape for experts that took ``load`` pairs each
    (any non-negative numbers): copies to the heaviest experts, packed heaviest first
    onto the least-loaded ranks; experts a rank keeps stay in their slots."""
    num_experts = len(load)
    per_rank = len(current) // num_ranks
    replicas = [1] * num_experts
    for _ in range(len(current) - num_experts):
        # At most one copy per rank; expert_split_problem keeps S <= E, so one fits.
        open_experts = [e for e in range(num_experts) if replicas[e] < num_ranks]
        heaviest = max(open_experts, key=lambda e: (load[e] / replicas[e], -e))
        replicas[heaviest] += 1
    copies = sorted(
        ((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
        key=lambda copy: (-copy[0], copy[1]),
    )
    held = [Counter(rank_slots(current, r, num_ranks)) for r in range(num_ranks)]
    assigned: list[Counter[int]] = [Counter() for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for weight, expert in copies:
        with_room = [r for r in range(num_ranks) if sum(assigned[r].values()) < per_rank]
        # Greedy packing can corner itself; then a rank may take a second copy.
        fresh = [r for r in with_room if not assigned[r][expert]] or with_room
        # Least loaded; on a tie, a rank that holds the expert already (nothing moves).
        rank = min(fresh, key=lambda r: (rank_load[r], not held[r][expert], r))
        assigned[rank][expert] += 1
        rank_load[rank] += weight
    placement: list[int] = []
    for r in range(num_ranks):
        wanted = assigned[r]
        kept: list[int | None] = []
        for expert in rank_slots(current, r, num_ranks):
            stays = wanted[expert] > 0
            wanted[expert] -= stays
            kept.append(expert if stays else None)
        arriving = sorted(wanted.elements())
        placement.extend(e if e is not None else arriving.pop(0) for e in kept)
    return tuple(placement)


def moves(old: Placement, new: Placement, num_ranks: int) -> list[tuple[int, int]]:
    """(destination slot, source slot) in ``old`` for every physical slot whose expert
    changes, in slot order: a copy on the destination's own rank if it has one, else
    the expert's first slot. Every rank derives the same list from the same placements."""
    per_rank = len(old) // num_ranks
    plan = []
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        first = slot - slot % per_rank
        local = [s for s in range(first, first + per_rank) if old[s] == expert]
        plan.append((slot, local[0] if local else old.index(expert)))
    return plan
