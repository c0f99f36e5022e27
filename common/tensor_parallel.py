"""How a model splits over a tensor-parallel group of ``tp_size`` ranks (Megatron-style).

Torch-free: the engine's loader, the KV budget check and ``pdserve config check`` share it.

Each rank holds ``num_q_heads / tp_size`` query heads and their KV heads, and the matching
slice of every MLP's intermediate width (of every expert's, for mixture-of-experts
models). When there are fewer KV heads than ranks, each KV head is held by
``tp_size / num_kv_heads`` consecutive ranks (a replica each), so that a rank's query
heads always find their KV head locally: GQA groups are never cut.

    q heads    | 0 1 | 2 3 | 4 5 | 6 7 |      8 query heads, 2 KV heads, tp_size 4:
    KV heads   |  0  |  0  |  1  |  1  |      rank r holds KV head r // 2
                 r0    r1    r2    r3
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """The attention heads rank ``tp_rank`` of ``tp_size`` holds."""

    num_q_heads: int  # the model's, all ranks together
    num_kv_heads: int
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def q_heads(self) -> int:
        return self.num_q_heads // self.tp_size

    @property
    def q_head_start(self) -> int:
        return self.tp_rank * self.q_heads

    @property
    def kv_heads(self) -> int:
        return local_kv_heads(self.num_kv_heads, self.tp_size)

    @property
    def kv_head_start(self) -> int:
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * self.kv_heads
        return self.tp_rank // (self.tp_size // self.num_kv_heads)  # a replica


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads per rank: a share of them, or one replicated head."""
    return max(1, num_kv_heads // tp_size)


def split_problem(
    num_q_heads: int, num_kv_heads: int, widths: Mapping[str, int], tp_size: int
) -> str | None:
    """Why the model cannot be split over ``tp_size`` ranks, or None if it can.
    ``widths``: each split MLP width by name ("intermediate_size", ...)."""
    if tp_size < 1:
        return f"must be >= 1, got {tp_size}"
    if tp_size == 1:
        return None
    if num_q_heads % tp_size:
        return f"{num_q_heads} attention heads do not split over {tp_size} ranks"
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return (
            f"{num_kv_heads} KV heads neither split over {tp_size} ranks nor divide it "
            "(each rank must hold whole KV heads, or one replica of one)"
        )
    for name, width in widths.items():
        if width % tp_size:
            return f"{name}={width} does not split over {tp_size} ranks"
    return None


def linear_split_problem(num_key_heads: int, num_value_heads: int, tp_size: int) -> str | None:
    """Why a hybrid model's linear-attention heads cannot be split over ``tp_size`` ranks
    (each rank whole key heads and the value heads that read them), or None."""
    if num_key_heads % tp_size or num_value_heads % tp_size:
        return (
            f"{num_key_heads} linear-attention key heads and {num_value_heads} value heads "
            f"do not both split over {tp_size} ranks"
        )
    return None


def mamba_split_problem(num_groups: int, num_heads: int, tp_size: int) -> str | None:
    """Why Mamba-2 layers cannot be split over ``tp_size`` ranks, or None: each rank whole
    heads, and the B/C groups its heads read: its share of them, or (fewer groups than
    ranks) a copy of the one group they all read."""
    if num_heads % tp_size or (num_groups % tp_size and tp_size % num_groups):
        return (
            f"{num_heads} Mamba-2 heads in {num_groups} groups do not split over {tp_size} "
            "ranks (the heads must, and the groups must split or divide the ranks)"
        )
    return None


def expert_split_problem(num_experts: int, num_redundant_experts: int, tp_size: int) -> str | None:
    """Why ``num_experts`` routed experts plus ``num_redundant_experts`` replicas cannot be
    dealt out whole over ``tp_size`` ranks (expert parallelism), or None if they can. Every
    rank holds ``(E + R) / N`` slots; at most ``E`` of them, so a rank never needs two
    copies of one expert."""
    num_slots = num_experts + num_redundant_experts
    if num_redundant_experts < 0:
        return f"num_redundant_experts must be >= 0, got {num_redundant_experts}"
    if num_slots % tp_size:
        if num_redundant_experts:
            return (
                f"{num_experts} routed experts + {num_redundant_experts} redundant do not "
                f"divide over tensor_parallel_size={tp_size} ranks"
            )
        return (
            f"{num_experts} routed experts do not divide over tensor_parallel_size={tp_size} ranks"
        )
    if num_slots // tp_size > num_experts:
        return (
            f"{num_redundant_experts} redundant experts give each of {tp_size} ranks "
            f"{num_slots // tp_size} expert slots, more than the {num_experts} experts"
        )
    return None
