"""Granite 4.0-H's Mamba-2 layer over a flattened batch whose requests each keep a
fixed-size state instead of a KV cache.

One input projection gives a gate ``z``, the convolution's channels (x, B and C) and one
time step per head. x, B and C go through a depthwise causal convolution (with bias) and
SiLU; x is ``num_heads`` heads of ``head_dim``, B and C are ``num_groups`` vectors of
``state_size``, each shared by ``num_heads / num_groups`` consecutive heads. Per token t,
per head, with ``dt_t = clamp(softplus(dt_t + dt_bias))`` (to the config's time step
limit) and ``S`` the head's [head_dim, state_size] state:

    S = exp(dt_t * A) * S + dt_t * x_t B_t^T      (A = -exp(A_log), one per head)
    y_t = S C_t + D * x_t

then ``y * silu(z)`` is RMS-normalized per group of channels (``norm_group_size``), scaled,
and projected out. A prompt chunk runs the chunked form (``chunked_ssd``: the state-space
duality's matrix products within chunks of ``chunk_size`` tokens, the state carried
between them); a decode runs one step (``ssm_step``), all decodes of a step together;
``recurrent.run_recurrence`` dispatches, as for the gated delta rule. Everything past the
projection runs in float32 (transformers' torch path computes the time steps in the
model dtype: equal in float32). Every token's time step is clamped, prompts' and decodes'
alike, so a token's output does not depend on how it was scheduled (computed in a prompt
chunk, decoded, verified as a draft, recomputed after preemption): mamba_ssm's decode
step and transformers' skip the clamp that their chunk scans (the training path) apply,
which moves Nemotron-H's decode log-probs (it clamps at 0.001) by ~2e-4 here.

Under tensor parallelism a rank holds whole heads and the B/C groups they read: its share
of the groups, or with fewer groups than ranks a copy of the one its heads read
(``Mamba2Config.group_ranks`` ranks share it, and its norm sums squares across them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.linear_state import LinearLayerState
from engine.models.arch import ModelArchConfig
from engine.models.lora import LoraBatch
from engine.models.recurrent import Rows, causal_conv, run_recurrence
from engine.parallel.group import SingleRank, TPGroup

SSD_CHUNK = 64  # tokens per chunk of the chunked form (any length gives the same states)


class GroupedGatedRMSNorm(nn.Module):
    """``x * silu(gate)``, RMS-normalized over each group of ``group_size`` channels, times
    the weight (float32; cast back to ``x``'s dtype at the end). A group shared by
    ``group_ranks`` ranks (this rank holds ``1 / group_ranks`` of its channels) sums its
    squares across them: each rank adds its share into its group's column of a
    [tokens, groups] tensor, and one all-reduce gives every group's sum."""

    def __init__(
        self, dim: int, group_size: int, eps: float, group_ranks: int, tp: TPGroup
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps
        self.group_ranks, self.tp = group_ranks, tp

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        gated = x.float() * F.silu(gate.float())  # [N, dim]
        if self.group_ranks == 1:  # whole groups here
            grouped = gated.view(gated.shape[0], -1, self.group_size)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight * grouped.view_as(gated)).to(dtype)
        squares = gated.new_zeros(gated.shape[0], self.tp.size // self.group_ranks)
        column = self.tp.rank // self.group_ranks
        squares[:, column] = gated.pow(2).sum(-1)
        mean = self.tp.all_reduce(squares)[:, column : column + 1] / self.group_size
        return (self.weight * (gated * torch.rsqrt(mean + self.eps))).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, group: TPGroup | None = None) -> None:
        super().__init__()
        mamba = arch.mamba2
        assert mamba is not None
        self.layer_idx = layer_idx
        self.mamba = mamba
        heads = mamba.num_heads
        self.in_proj = nn.Linear(arch.hidden_size, sum(mamba.in_proj_widths), bias=mamba.proj_bias)
        self.conv1d = nn.Module()  # transformers' Conv1d: weight [conv_dim, 1, kernel], bias
        self.conv1d.weight = nn.Parameter(torch.empty(mamba.conv_dim, 1, mamba.conv_kernel))
        self.conv1d.bias = nn.Parameter(torch.empty(mamba.conv_dim)) if mamba.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GroupedGatedRMSNorm(
            mamba.intermediate_size, mamba.norm_group_size, arch.rms_norm_eps,
            mamba.group_ranks, group or SingleRank(),
        )  # fmt: skip
        self.out_proj = nn.Linear(mamba.intermediate_size, arch.hidden_size, bias=mamba.proj_bias)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        state: LinearLayerState,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        mamba = self.mamba
        num_tokens = hidden.shape[0]
        projected = self.in_proj(hidden)
        if lora is not None:
            projected = lora.apply(self.layer_idx, "in_proj", hidden, projected)
        # [N, intermediate], [N, conv_dim], [N, heads]
        z, mixed, dt = projected.split(mamba.in_proj_widths, -1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(mamba.dt_min, mamba.dt_max)
        weight = self.conv1d.weight[:, 0].float()  # [conv_dim, kernel]
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        mixed = F.silu(causal_conv(mixed, state.conv, state.step, weight, bias))
        group_width = mamba.num_groups * mamba.state_size
        x, b, c = mixed.split([mamba.intermediate_size, group_width, group_width], -1)
        x = x.reshape(num_tokens, mamba.num_heads, mamba.head_dim)  # [N, H, P]
        b = b.reshape(num_tokens, mamba.num_groups, -1)  # [N, G, S]
        c = c.reshape(num_tokens, mamba.num_groups, -1)
        repeat = mamba.num_heads // mamba.num_groups  # consecutive heads share a group
        x_dt = x * dt[..., None]  # [N, H, P]: what each token writes, B aside
        decay = dt * -self.A_log.float().exp()  # [N, H] log decay, <= 0
        out = torch.empty_like(x)

        def one_token(rows: Rows, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b_heads, c_heads = (t[rows].repeat_interleave(repeat, 1) for t in (b, c))
            return ssm_step(x_dt[rows], decay[rows], b_heads, c_heads, states)

        def chunk(rows: slice, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return chunked_ssd(x_dt[rows], decay[rows], b[rows], c[rows], states)

        run_recurrence(state.ssm, state.step, out, one_token, chunk)
        out = out + x * self.D.float()[:, None]
        normed = self.norm(out.reshape(num_tokens, -1), z).to(hidden.dtype)
        if lora is None:
            return self.out_proj(normed)
        return lora.apply(self.layer_idx, "out_proj", normed, self.out_proj(normed))


def ssm_step(
    x_dt: torch.Tensor,  # [B, H, P] the token's x times its time step
    decay: torch.Tensor,  # [B, H] log decay
    b: torch.Tensor,  # [B, H, S]
    c: torch.Tensor,  # [B, H, S]
    state: torch.Tensor,  # [B, H, P, S] float32, updated in place (callers pass copies)
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, H, P] (before D), the new state
    """One token of the SSM for each of B requests. In place: the state is the largest
    tensor a decode touches (4 MiB per request and layer for Granite-4.0-H-Small), and a
    product of new tensors read and wrote it 2.4x as often (``decode@128`` 0.46x the
    dense model's, in ``benchmarks/results/hybrid_granite_cpu.md``, before this)."""
    state.mul_(decay.exp()[..., None, None])
    head_dim, size = state.shape[-2:]
    flat = state.view(-1, head_dim, size)
    flat.baddbmm_(x_dt.reshape(-1, head_dim, 1), b.reshape(-1, 1, size))  # += x_dt B^T
    return (state @ c[..., None])[..., 0], state


def chunked_ssd(
    x_dt: torch.Tensor,  # [T, H, P]
    decay: torch.Tensor,  # [T, H] log decay
    b: torch.Tensor,  # [T, G, S] (G divides H: consecutive heads share a group)
    c: torch.Tensor,  # [T, G, S]
    state: torch.Tensor,  # [H, P, S] float32: the state before token 0
    chunk: int = SSD_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, P] (before D), the state after T - 1
    """The SSM over one request's T tokens, ``chunk`` at a time. Within a chunk, with G the
    cumulative log decay from its start, token i's output is what the incoming state
    gives, ``exp(G_i) C_i S``, plus each earlier token j's write read back,
    ``sum_{j <= i} exp(G_i - G_j) (C_i . B_j) x_dt_j`` (one masked matrix product: the
    duality with attention); the state leaving it is ``exp(G_last) S + sum_j
    exp(G_last - G_j) x_dt_j B_j^T``. Padded tokens write nothing and do not decay.
    ``C_i . B_j`` is computed once per group, not per head (Granite: 128 heads, 1 group)."""
    length, heads, head_dim = x_dt.shape
    groups = b.shape[1]
    repeat = heads // groups
    pad = (-length) % chunk
    num_chunks = (length + pad) // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [T, K, D] -> [K, C, L, D], padded
        padded = F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1)
        return padded.reshape(t.shape[1], num_chunks, chunk, -1)

    x, bs, cs = chunked(x_dt), chunked(b), chunked(c)  # [H, C, L, P], [G, C, L, S] x 2
    g = F.pad(decay, (0, 0, 0, pad)).transpose(0, 1).reshape(heads, num_chunks, chunk).cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    pair_decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    scores = (cs @ bs.transpose(-1, -2)).repeat_interleave(repeat, 0)  # [H, C, L, L]
    within = (scores * pair_decay) @ x  # [H, C, L, P]
    last = g[..., -1:]  # [H, C, 1]
    x_to_end = x * (last - g).exp()[..., None]  # [H, C, L, P]
    from_state = g.exp()[..., None]  # [H, C, L, 1]
    out = torch.empty_like(x)
    for i in range(num_chunks):
        by_group = state.view(groups, repeat, head_dim, -1)  # [G, r, P, S]
        read = cs[:, i, None] @ by_group.transpose(-1, -2)  # [G, r, L, P]
        out[:, i] = within[:, i] + from_state[:, i] * read.reshape(heads, chunk, head_dim)
        written = x_to_end[:, i].view(groups, repeat, chunk, head_dim).transpose(-1, -2)
        written = (written @ bs[:, i, None]).reshape(state.shape)  # [H, P, S]
        state = state * last[:, i, :, None].exp() + written
    out = out.reshape(heads, num_chunks * chunk, -1)[:, :length].transpose(0, 1)
    return out, state
