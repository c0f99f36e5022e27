"""Mixture-of-experts MLP in Triton: the GPU twin of ``reference.moe_experts``.

A step's (token, expert) pairs ("slots": token t's i-th choice is slot ``t * k + i``) are
sorted by expert on the device and each expert's run is padded to a multiple of
``BLOCK_M`` (``align_by_expert``); one grouped-GEMM launch then has a program per
(``BLOCK_M`` slots of one expert, ``BLOCK_N`` output columns), which gathers its tokens'
rows, multiplies them by that expert's weights and writes each slot's row. Two launches
make the MLP: gate/up (then SiLU(gate) * up in torch; GPT-OSS's clamped variant likewise;
Nemotron-H's ungated experts: up rows alone, then relu(up) ** 2),
and down with each slot's routing weight applied in the epilogue (expert biases, when the
model has them, are added there first); the k rows of a token are summed at the end (no atomics,
so the result does not depend on scheduling).

Nothing reads a count on the host: the grid is sized by the worst case (every expert's
run padded by ``BLOCK_M - 1``), and blocks past the last expert's run exit at once. So a
step's MoE layers are capturable in a CUDA graph, and the engine's decode graphs cover
MoE models on the triton backend. This is the layout of vLLM's and SGLang's fused MoE
(``moe_align_block_size``), written here from the idea, not their code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.intmath import cdiv
from kernels.reference import swiglu
from kernels.triton_utils import dot_dtype, dot_precision, require_runnable


def align_by_expert(
    expert_ids: torch.Tensor,  # [num_tokens, k] int64
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots [num_blocks * block_m] int64, block_experts [num_blocks] int64).

    ``sorted_slots`` lists each expert's slots in token order, each expert's run padded to
    a multiple of ``block_m`` with ``num_slots`` (past the end); ``block_experts[b]`` is the
    expert of block ``b``, or ``num_experts`` for blocks after the last run. Slots of id
    ``num_experts`` (another rank's experts, under expert parallelism) are left out. Shapes
    depend only on ``num_tokens``, ``k``, ``num_experts`` and ``block_m``.
    """
    device = expert_ids.device
    flat = expert_ids.reshape(-1)  # [num_slots]
    num_slots = flat.numel()
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    # One more count for id num_experts, whose run gets no room (padded to 0).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync (bincount syncs)
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    run_starts = torch.cumsum(counts, 0) - counts  # [E + 1] exclusive
    padded_ends = torch.cumsum(padded, 0)  # [E + 1] inclusive
    sorted_experts = flat[order]
    rank = torch.arange(num_slots, device=device) - run_starts[sorted_experts]
    dest = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    num_blocks = cdiv(num_slots + num_experts * (block_m - 1), block_m)
    # The left-out slots all land on one spare element past the end, cut off after.
    dest = dest.masked_fill(sorted_experts == num_experts, num_blocks * block_m)
    sorted_slots = torch.full((num_blocks * block_m + 1,), num_slots, dtype=torch.int64,
                              device=device)  # fmt: skip
    sorted_slots.scatter_(0, dest, order)
    block_starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    block_experts = torch.searchsorted(padded_ends[:num_experts], block_starts, right=True)
    return sorted_slots[:-1], block_experts


@triton.jit
def _grouped_matmul_kernel(
    a_ptr,  # [num_a_rows, K]: the rows slots read (slot // A_ROW_DIV)
    w_ptr,  # [num_experts, N, K]
    out_ptr,  # [num_slots, N]
    sorted_slots_ptr,  # [num_blocks * BLOCK_M] int64
    block_experts_ptr,  # [num_blocks] int64
    scale_ptr,  # [num_slots] (read only with HAS_SCALE)
    bias_ptr,  # [num_experts, N] (read only with HAS_BIAS)
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_be,
    NUM_EXPERTS: tl.constexpr,
    A_ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    a_rows = tl.where(valid, slots // A_ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the expert's rows, transposed
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:  # before the routing weight, as out = (a @ w + b) * weight
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if HAS_SCALE:
        scale = tl.load(scale_ptr + tl.where(valid, slots, 0), mask=valid, other=0.0)
        acc = acc * scale.to(tl.float32)[:, None]
    tl.store(
        out_ptr + tl.where(valid, slots, 0)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def _block_m(num_slots: int, num_experts: int) -> int:
    """Slots per program: 16 (tl.dot's minimum) when experts get few tokens each (decode),
    up to 64 when they get many (prefill)."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _grouped_matmul(
    a: torch.Tensor,  # [num_a_rows, K]
    weight: torch.Tensor,  # [num_experts, N, K]
    out: torch.Tensor,  # [num_slots, N]
    sorted_slots: torch.Tensor,
    block_experts: torch.Tensor,
    block_m: int,
    a_row_div: int,
    scale: torch.Tensor | None,  # [num_slots]
    bias: torch.Tensor | None = None,  # [num_experts, N]
) -> None:
    num_experts, n, k = weight.shape
    block_n = 64 if n >= 64 else 32
    block_k = 64 if k >= 64 else 32
    grid = (block_experts.shape[0], cdiv(n, block_n))
    bias = bias.contiguous() if bias is not None else None
    _grouped_matmul_kernel[grid](
        a, weight, out, sorted_slots, block_experts, scale if scale is not None else out,
        bias if bias is not None else out, out.shape[0], n, k, a.stride(0), weight.stride(0),
        weight.stride(1), out.stride(0), bias.stride(0) if bias is not None else 0,
        NUM_EXPERTS=num_experts, A_ROW_DIV=a_row_div, HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(_grouped_matmul_kernel, a.dtype),
        DOT_PRECISION=dot_precision(a.dtype),
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    expert_ids: torch.Tensor,  # [num_tokens, k] int64
    weights: torch.Tensor,  # [num_tokens, k]
    *,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
    other_experts: bool = False,
    activation: str = "swiglu",
) -> torch.Tensor:  # [num_tokens, H]
    """sum_i weights[t, i] * down(SiLU(gate(x_t)) * up(x_t)) over token t's k experts; the
    biases and the clamped SwiGLU as ``reference.moe_experts`` (GPT-OSS); with
    ``activation`` "relu2" (``gate_up_proj`` [E, I, H] of up rows alone: Nemotron-H's)
    down(relu(up(x_t)) ** 2). With ``other_experts`` some ids may be E (experts another
    rank holds), which add nothing."""
    num_tokens, top_k = expert_ids.shape
    num_experts, up_rows, hidden_size = gate_up_proj.shape
    gated = activation == "swiglu"
    if hidden.shape != (num_tokens, hidden_size) or down_proj.shape != (
        num_experts,
        hidden_size,
        up_rows // 2 if gated else up_rows,
    ):
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, gate_up_proj {tuple(gate_up_proj.shape)} and "
            f"down_proj {tuple(down_proj.shape)} do not fit {num_tokens} tokens"
        )
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    require_runnable(_grouped_matmul_kernel, hidden, gate_up_proj, down_proj, expert_ids)
    hidden = hidden.contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    num_slots = num_tokens * top_k
    block_m = _block_m(num_slots, num_experts)
    sorted_slots, block_experts = align_by_expert(expert_ids, num_experts, block_m)
    routed = (sorted_slots, block_experts, block_m)
    gate_up = hidden.new_empty(num_slots, up_rows)  # [slots, 2I] ([slots, I] ungated)
    _grouped_matmul(hidden, gate_up_proj, gate_up, *routed, a_row_div=top_k, scale=None,
                    bias=gate_up_bias)  # fmt: skip
    if gated:
        gate, up = gate_up.chunk(2, dim=-1)
        activated = swiglu(gate, up, swiglu_limit, swiglu_alpha).contiguous()  # [slots, I]
    else:
        activated = torch.relu(gate_up).square_()
    # [slots, H], weighted; every slot written, but another rank's expert's (left out,
    # so zeroed first: a memset kept off the plain path).
    down = (hidden.new_zeros if other_experts else hidden.new_empty)(num_slots, hidden_size)
    _grouped_matmul(activated, down_proj, down, *routed, a_row_div=1,
                    scale=weights.reshape(-1).contiguous(), bias=down_bias)  # fmt: skip
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)
