"""The fused MoE kernel against ``reference.moe_experts``: expert alignment, and the MLP
over shapes with empty experts, one token, odd widths, k = 1 and k = E, and every dtype."""

from __future__ import annotations

import pytest
import torch

import tests.kernels.triton_env  # noqa: F401  (sets TRITON_INTERPRET before kernels load)

# isort: split

from kernels.fused_moe import align_by_expert, fused_moe
from kernels.reference import moe_experts
from tests.kernels.triton_env import DEVICE

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, skewed: bool = False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if skewed:  # most tokens pick the same few experts; some experts get none
        logits[:, : num_experts // 2] -= 10.0
    weights, expert_ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return expert_ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("block_m", [16, 32])
def test_alignment_lists_each_experts_slots_padded_to_whole_blocks(block_m):
    num_tokens, num_experts, top_k = 37, 6, 2
    expert_ids, _ = _routing(num_tokens, num_experts, top_k, seed=1, skewed=True)
    sorted_slots, block_experts = align_by_expert(expert_ids, num_experts, block_m)
    num_slots = num_tokens * top_k
    flat = expert_ids.reshape(-1).cpu()
    slots, experts = sorted_slots.cpu(), block_experts.cpu()
    assert slots.numel() == experts.numel() * block_m
    seen = []
    for block, expert in enumerate(experts.tolist()):
        rows = slots[block * block_m : (block + 1) * block_m].tolist()
        real = [s for s in rows if s < num_slots]
        if expert == num_experts:  # past the last run: nothing real
            assert real == []
            continue
        assert all(flat[s] == expert for s in real)
        assert real == sorted(real)  # token order within an expert
        assert rows[: len(real)] == real  # padding only at a run's end
        seen += real
    assert sorted(seen) == list(range(num_slots))  # every slot exactly once
    assert set(experts.tolist()) - {num_experts} == set(flat.tolist())  # empty ones: no block


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "num_experts", "top_k", "skewed"),
    [
        (1, 64, 32, 4, 2, False),  # one token (decode at batch 1)
        (19, 64, 48, 8, 2, True),  # empty experts; inter not a multiple of the tile
        (40, 96, 64, 4, 1, False),  # k = 1; hidden not a power of two
        (9, 32, 32, 3, 3, False),  # k = E: every expert for every token
        (130, 64, 32, 4, 2, True),  # many tokens per expert: bigger blocks
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_fused_moe_matches_the_reference(num_tokens, hidden, inter, num_experts, top_k,
                                         skewed, dtype, activation):  # fmt: skip
    """SwiGLU experts, and Nemotron-H's ungated squared-ReLU ones (up rows alone)."""
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE, dtype)
    rows = 2 * inter if activation == "swiglu" else inter
    gate_up = (torch.randn(num_experts, rows, hidden, generator=generator)
               / hidden**0.5).to(DEVICE, dtype)  # fmt: skip
    down = (torch.randn(num_experts, hidden, inter, generator=generator)
            / inter**0.5).to(DEVICE, dtype)  # fmt: skip
    expert_ids, weights = _routing(num_tokens, num_experts, top_k, seed=num_tokens, skewed=skewed)
    weights = weights.to(dtype)
    got = fused_moe(x, gate_up, down, expert_ids, weights, activation=activation)
    expected = moe_experts(x.float(), gate_up.float(), down.float(), expert_ids, weights.float(),
                           activation=activation)  # fmt: skip
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])  # fmt: skip


@pytest.mark.parametrize(
    ("num_tokens", "dtype"), [(1, torch.float32), (37, torch.float32), (37, torch.bfloat16)]
)
def test_gpt_oss_experts_match_the_reference(num_tokens, dtype):
    """Biases on both projections (the down bias before the routing weight) and the
    clamped SwiGLU, with inputs large enough that the clamps bite."""
    num_experts, top_k, hidden, inter = 6, 2, 64, 48
    generator = torch.Generator().manual_seed(7 + num_tokens)
    x = (3 * torch.randn(num_tokens, hidden, generator=generator)).to(DEVICE, dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=generator)
               / hidden**0.5).to(DEVICE, dtype)  # fmt: skip
    down = (torch.randn(num_experts, hidden, inter, generator=generator)
            / inter**0.5).to(DEVICE, dtype)  # fmt: skip
    gate_up_bias = torch.randn(num_experts, 2 * inter, generator=generator).to(DEVICE, dtype)
    down_bias = torch.randn(num_experts, hidden, generator=generator).to(DEVICE, dtype)
    expert_ids, weights = _routing(num_tokens, num_experts, top_k, seed=num_tokens, skewed=True)
    gpt_oss = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
    got = fused_moe(x, gate_up, down, expert_ids, weights.to(dtype),
                    gate_up_bias=gate_up_bias, down_bias=down_bias, **gpt_oss)  # fmt: skip
    expected = moe_experts(
        x.float(), gate_up.float(), down.float(), expert_ids, weights,
        gate_up_bias=gate_up_bias.float(), down_bias=down_bias.float(), **gpt_oss,
    )  # fmt: skip
    pre_activation = torch.einsum("th,eih->tei", x.float(), gate_up.float())
    assert (pre_activation.abs() > 7.0).any()  # the clamps are in play
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * 10,
                               rtol=TOLERANCE[dtype])  # fmt: skip
    plain = fused_moe(x, gate_up, down, expert_ids, weights.to(dtype))
    assert not torch.allclose(plain.float(), expected, atol=0.1)


def test_no_tokens_and_bad_shapes():
    gate_up = torch.zeros(4, 64, 32, device=DEVICE)
    down = torch.zeros(4, 32, 32, device=DEVICE)
    empty = torch.zeros(0, 32, device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert fused_moe(empty, gate_up, down, ids, torch.zeros(0, 2, device=DEVICE)).shape == (0, 32)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(torch.zeros(3, 16, device=DEVICE), gate_up, down,
                  torch.zeros(3, 2, dtype=torch.int64, device=DEVICE),
                  torch.zeros(3, 2, device=DEVICE))  # fmt: skip


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_expert_parallel_ranks_add_up_to_all_experts(num_ranks, fused):
    """Each rank holds E / N whole experts and sees the others' as id E (``SparseMoe``
    under expert parallelism): its output is its experts' share, and the ranks' outputs
    add up to every expert's. A rank with no token routed to it gives zeros."""
    num_tokens, num_experts, top_k, hidden, inter = 29, 8, 2, 64, 32
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=generator)
               / hidden**0.5).to(DEVICE)  # fmt: skip
    down = (torch.randn(num_experts, hidden, inter, generator=generator)
            / inter**0.5).to(DEVICE)  # fmt: skip
    down_bias = torch.randn(num_experts, hidden, generator=generator).to(DEVICE)
    expert_ids, weights = _routing(num_tokens, num_experts, top_k, seed=5, skewed=True)
    run = fused_moe if fused else moe_experts
    expected = moe_experts(x, gate_up, down, expert_ids, weights, down_bias=down_bias)
    local = num_experts // num_ranks
    total = torch.zeros_like(expected)
    for rank in range(num_ranks):
        ids = expert_ids - rank * local
        outside = (ids < 0) | (ids >= local)
        ids = ids.masked_fill(outside, local)
        part = slice(rank * local, (rank + 1) * local)
        out = run(x, gate_up[part], down[part], ids, weights, down_bias=down_bias[part],
                  other_experts=True)  # fmt: skip
        if outside.all():
            assert not out.any()
        total += out
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)
