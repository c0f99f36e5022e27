"""Exchanging routed experts between ranks for a new placement (``expert_placement.py``).

Every rank calls ``move_experts`` with the same placements, between steps. The moves
(``expert_placement.moves``) run in one order on every rank: a move within a rank is a
local copy; a move across ranks broadcasts the source slot's tensors from their rank
(every rank takes part, only the destination keeps them: a collective needs no pairing
of sends and receives, so no order of them can deadlock). A layer's arrivals are written
after all of its moves were read, since a slot may be a source and a destination at
once. The slots' tensors are every parameter of ``moe.experts`` (each ``[S, ...]``), so
expert biases move with their weights.
"""

from __future__ import annotations

import torch

from engine.models.moe import SparseMoe
from engine.parallel.expert_placement import Placement, moves
from engine.parallel.group import TPGroup


@torch.no_grad()
def move_experts(moe: SparseMoe, new: Placement, group: TPGroup) -> int:
    """Put ``new``'s experts into this rank's slots of ``moe`` and route by it; returns
    the slots (of all ranks) that changed expert."""
    old = moe.expert_placement
    assert old is not None and len(old) == len(new), (old, new)
    per_rank = moe.num_local_experts
    params = list(moe.experts.parameters())
    assert all(p.shape[0] == per_rank for p in params), [p.shape for p in params]
    rank = group.rank
    plan = moves(old, new, group.size)
    arrived: list[tuple[int, list[torch.Tensor]]] = []  # (local slot, one tensor per param)
    for dest, source in plan:
        dest_rank, source_rank = dest // per_rank, source // per_rank
        source_slot = source - source_rank * per_rank
        if dest_rank == source_rank:
            if rank == dest_rank:
                arrived.append((dest % per_rank, [p[source_slot].clone() for p in params]))
            continue
        tensors = [
            p[source_slot].clone() if rank == source_rank else torch.empty_like(p[0])
            for p in params
        ]
        for tensor in tensors:
            group.broadcast(tensor, source_rank)
        if rank == dest_rank:
            arrived.append((dest % per_rank, tensors))
    for slot, tensors in arrived:
        for param, tensor in zip(params, tensors, strict=True):
            param[slot].copy_(tensor)
    moe.set_placement(new)
    return len(plan)
