"""Routing pairs to expert slots under expert parallelism (``moe.slots_of_pairs``)."""

from __future__ import annotations

import torch

from engine.models.moe import slots_of_pairs
from engine.parallel.expert_placement import rank_slots, replica_table


def test_each_pair_runs_on_exactly_one_rank_and_copies_share_an_experts_pairs():
    placement = (3, 1, 2, 0, 4, 5, 6, 7, 0, 3)  # experts 0 and 3 on both ranks
    num_ranks, per_rank = 2, 5
    expert_ids = torch.randint(0, 8, (64, 2), generator=torch.Generator().manual_seed(0))
    expert_ids[:16] = torch.tensor([0, 3])  # 16 tokens route to both copied experts
    runs = torch.zeros_like(expert_ids)
    on_rank = []
    for rank in range(num_ranks):
        slots, counts = replica_table(placement, 8, rank, num_ranks)
        local = slots_of_pairs(expert_ids, torch.tensor(slots), torch.tensor(counts))
        mine = local < per_rank
        held = torch.tensor(rank_slots(placement, rank, num_ranks))
        assert torch.equal(held[local[mine]], expert_ids[mine])  # the slot holds the expert
        runs += mine
        on_rank.append(mine)
    assert torch.equal(runs, torch.ones_like(runs))
    for expert in (0, 3):
        pairs = expert_ids == expert
        # Consecutive tokens alternate copies, whichever top-k column names the expert.
        assert [int((mine & pairs)[:16].sum()) for mine in on_rank] == [8, 8]
        shares = [int((mine & pairs).sum()) for mine in on_rank]
        assert min(shares) >= sum(shares) / 3
    # An expert with one slot runs wholly on its rank.
    assert int((on_rank[1] & (expert_ids == 7)).sum()) == int((expert_ids == 7).sum())
