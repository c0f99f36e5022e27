"""Expert placement (``engine/parallel/expert_placement.py``): the loaded placement, the
routing tables, rebalancing by load, and the moves between two placements."""

from __future__ import annotations

import random

import pytest

from common.config_base import ConfigError
from common.engine_config import EngineConfig
from common.tensor_parallel import expert_split_problem
from engine.parallel.expert_placement import (
    imbalance,
    loaded_placement,
    moves,
    rank_slots,
    rebalance,
    replica_table,
)


def test_the_loaded_placement_and_its_tables():
    assert loaded_placement(8, 0, 2) == tuple(range(8))  # contiguous ranges
    placement = loaded_placement(8, 2, 2)
    assert placement == (0, 1, 2, 7, 4, 5, 6, 3, 0, 1)
    # Copies of experts 0 and 1, on both ranks: equal loads are shared equally.
    assert imbalance([[1.0] * 8], [placement], 2) == 1.0
    assert imbalance([[1.0] * 8], [loaded_placement(8, 4, 4)], 4) == 1.0
    # Not so the copies simply appended: rank 1 (3, 4, 5) runs 2.5 experts, rank 0 1.5.
    assert imbalance([[1.0] * 8], [(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)], 4) == 1.25
    assert rank_slots(placement, 1, 2) == (5, 6, 3, 0, 1)
    slots, counts = replica_table(placement, 8, 1, 2)
    assert counts == [2, 2, 1, 1, 1, 1, 1, 1]
    # Expert 0's copies: physical 0 (rank 0's: 5 = another rank's), then rank 1's slot 3.
    assert slots[0] == [5, 3, 5] and slots[5] == [0, 5, 5] and slots[2] == [5, 5, 5]
    slots, _ = replica_table(placement, 8, 0, 2)
    assert slots[0] == [0, 5, 5] and slots[5] == [5, 5, 5] and slots[7] == [3, 5, 5]
    with pytest.raises(ValueError, match="expert 7 has no slot"):
        replica_table((0, 1, 2, 3, 4, 5, 6, 0), 8, 0, 2)


def _zipf(num_experts: int, rng: random.Random) -> list[float]:
    """Skewed loads, as real routers' are: a few hot experts, a long tail."""
    ranks = list(range(1, num_experts + 1))
    rng.shuffle(ranks)
    return [1000.0 / r for r in ranks]


@pytest.mark.parametrize(
    ("num_experts", "redundant", "num_ranks"), [(8, 0, 2), (8, 2, 2), (16, 4, 4), (64, 8, 8)]
)
def test_rebalancing_keeps_every_expert_and_balances_the_ranks(num_experts, redundant, num_ranks):
    rng = random.Random(num_experts + redundant)
    current = loaded_placement(num_experts, redundant, num_ranks)
    per_rank = len(current) // num_ranks
    for _ in range(20):
        load = _zipf(num_experts, rng)
        new = rebalance(load, current, num_ranks)
        assert len(new) == len(current) and set(new) == set(range(num_experts))
        for rank in range(num_ranks):
            slots = rank_slots(new, rank, num_ranks)
            assert len(set(slots)) == per_rank  # never two copies of one expert on a rank
        before, after = imbalance([load], [current], num_ranks), imbalance([load], [new], num_ranks)
        assert after <= before
        assert after < 1.1  # the loaded placement's is 1.05-3.37 on these loads
        # An expert a rank keeps stays in its slot: only experts new to a rank move.
        for dest, source in moves(current, new, num_ranks):
            rank = dest // per_rank
            assert new[dest] not in rank_slots(current, rank, num_ranks)
            assert current[source] == new[dest]
        current = new
    assert rebalance(load, current, num_ranks) == current  # the same load: nothing moves


def test_copies_go_to_the_hot_experts():
    load = [100.0, 1, 1, 1, 50, 1, 1, 1]
    new = rebalance(load, loaded_placement(8, 2, 2), 2)
    assert new.count(0) == 2 and new.count(4) == 2
    assert imbalance([load], [new], 2) == 1.0
    assert imbalance([[0.0] * 8], [new], 2) == 1.0  # nothing routed


def test_applying_the_moves_gives_the_new_placement():
    rng = random.Random(3)
    old = loaded_placement(16, 4, 4)
    for _ in range(10):
        new = rebalance(_zipf(16, rng), old, 4)
        slots = list(old)
        for dest, source in moves(old, new, 4):
            slots[dest] = old[source]  # read from the old placement: swaps are safe
        assert tuple(slots) == new
        old = new


def test_split_problems():
    assert expert_split_problem(8, 0, 2) is None
    assert expert_split_problem(8, 2, 2) is None
    assert "do not divide" in expert_split_problem(6, 0, 4)
    assert "+ 1 redundant do not divide" in expert_split_problem(8, 1, 2)
    assert "more than the 8 experts" in expert_split_problem(8, 10, 2)  # 9 slots a rank
    assert expert_split_problem(8, 8, 2) is None  # every expert on both ranks


@pytest.mark.parametrize("key", ["num_redundant_experts", "expert_rebalance_interval"])
def test_balancing_needs_expert_parallelism(key):
    with pytest.raises(ConfigError, match="needs engine.expert_parallel") as error:
        EngineConfig(**{key: 2})
    assert error.value.key == f"engine.{key}"
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        EngineConfig(expert_parallel=True, **{key: 2})
    with pytest.raises(ConfigError, match="must be >= 0"):
        EngineConfig(expert_parallel=True, tensor_parallel_size=2, **{key: -1})
    EngineConfig(expert_parallel=True, tensor_parallel_size=2, **{key: 2})
