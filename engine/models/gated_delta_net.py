"""Qwen3.5's linear-attention layer: a causal convolution, then the gated delta rule, over
a flattened batch whose requests each keep a fixed-size state instead of a KV cache.

Per token t of a request, per value head (its key head shared by ``num_value_heads /
num_key_heads`` value heads), with q and k L2-normalized and q scaled by ``key_head_dim **
-0.5``, ``S`` the head's [key_head_dim, value_head_dim] state:

    S = exp(g_t) * S                       (decay: g_t = -exp(A_log) * softplus(a_t + dt_bias))
    S = S + k_t (beta_t (v_t - S^T k_t))^T (the delta rule: beta_t = sigmoid(b_t))
    o_t = S^T q_t

then a gated RMSNorm (``norm(o) * silu(z)``) and the output projection. q, k and v come
from one projection through a depthwise causal convolution (``conv_kernel`` taps, SiLU)
whose state is the last ``conv_kernel - 1`` inputs.

A prompt chunk runs the chunked form (``chunked_delta_rule``: the same recurrence in
matrix products over chunks of ``DELTA_CHUNK`` tokens, as transformers' and FLA's); a
decode token runs one step of the recurrence, all decodes of a step together
(``delta_rule_step``); a decode verifying drafts runs that step once per token,
keeping the states after each (``recurrent.run_recurrence`` dispatches). All read and
write the request's state in the layer's slice of the engine's state pool
(``engine/linear_state.py``), picked by the step's slots.
Everything past the projections runs in float32, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.linear_state import LinearLayerState
from engine.models.arch import ModelArchConfig
from engine.models.lora import LoraBatch
from engine.models.recurrent import Rows, causal_conv, run_recurrence

DELTA_CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's output, times SiLU of the gate (float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        linear = arch.linear_attention
        assert linear is not None
        self.layer_idx = layer_idx
        self.linear = linear
        hidden = arch.hidden_size
        # The checkpoint's in_proj_qkv, _z, _b and _a, fused at load (``loader.py``): one
        # matrix product where four ran (four made prompts 0.73x the dense model's).
        self.in_proj = nn.Linear(hidden, sum(linear.in_proj_widths), bias=False)
        self.conv1d = nn.Module()  # transformers' Conv1d weight [conv_dim, 1, kernel]
        self.conv1d.weight = nn.Parameter(torch.empty(linear.conv_dim, 1, linear.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(linear.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(linear.num_value_heads))
        self.norm = GatedRMSNorm(linear.value_head_dim, arch.rms_norm_eps)
        self.out_proj = nn.Linear(linear.value_dim, hidden, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        state: LinearLayerState,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        linear = self.linear
        num_tokens = hidden.shape[0]
        projected = self.in_proj(hidden)
        if lora is not None:
            projected = lora.apply(self.layer_idx, "in_proj", hidden, projected)
        # [N, conv_dim], [N, value_dim], [N, Hv], [N, Hv]
        mixed, z, b, a = projected.split(linear.in_proj_widths, -1)
        beta = b.float().sigmoid()  # [N, Hv]
        decay = -self.A_log.float().exp() * F.softplus(
            a.float() + self.dt_bias.float()
        )  # [N, Hv] (log space, <= 0)
        weight = self.conv1d.weight[:, 0].float()  # [conv_dim, kernel]
        mixed = F.silu(causal_conv(mixed, state.conv, state.step, weight, None))  # [N, conv_dim]
        query, key, value = mixed.split([linear.key_dim, linear.key_dim, linear.value_dim], -1)
        repeat = linear.num_value_heads // linear.num_key_heads
        query = query.reshape(num_tokens, linear.num_key_heads, -1)
        key = key.reshape(num_tokens, linear.num_key_heads, -1)
        if repeat > 1:  # each key head serves consecutive value heads
            query = query.repeat_interleave(repeat, dim=1)
            key = key.repeat_interleave(repeat, dim=1)
        query = _l2_normalized(query) * linear.key_head_dim**-0.5  # [N, Hv, Dk]
        key = _l2_normalized(key)
        value = value.reshape(num_tokens, linear.num_value_heads, -1)  # [N, Hv, Dv]
        out = torch.empty_like(value)

        def one_token(rows: Rows, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return delta_rule_step(query[rows], key[rows], value[rows], decay[rows],
                                   beta[rows], states)  # fmt: skip

        def chunk(rows: slice, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return chunked_delta_rule(query[rows], key[rows], value[rows], decay[rows],
                                      beta[rows], states)  # fmt: skip

        run_recurrence(state.ssm, state.step, out, one_token, chunk)
        z = z.reshape(num_tokens, linear.num_value_heads, -1)
        normed = self.norm(out.to(hidden.dtype), z).reshape(num_tokens, linear.value_dim)
        if lora is None:
            return self.out_proj(normed)
        return lora.apply(self.layer_idx, "out_proj", normed, self.out_proj(normed))


def _l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """Each head's vector over its L2 norm (float32; eps 1e-6 under the root, as FLA)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_step(
    query: torch.Tensor,  # [B, H, Dk] (normalized, scaled)
    key: torch.Tensor,  # [B, H, Dk] (normalized)
    value: torch.Tensor,  # [B, H, Dv]
    decay: torch.Tensor,  # [B, H] log decay
    beta: torch.Tensor,  # [B, H]
    state: torch.Tensor,  # [B, H, Dk, Dv] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, H, Dv], new state
    """One token of the gated delta rule for each of B requests."""
    state = state * decay.exp()[..., None, None]
    predicted = (state * key[..., None]).sum(-2)  # S^T k: [B, H, Dv]
    delta = (value - predicted) * beta[..., None]
    state = state + key[..., None] * delta[..., None, :]
    return (state * query[..., None]).sum(-2), state


def chunked_delta_rule(
    query: torch.Tensor,  # [T, H, Dk] (normalized, scaled)
    key: torch.Tensor,  # [T, H, Dk] (normalized)
    value: torch.Tensor,  # [T, H, Dv]
    decay: torch.Tensor,  # [T, H] log decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] float32: the state before token 0
    chunk: int = DELTA_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, Dv], the state after token T - 1
    """The gated delta rule over one request's T tokens, ``chunk`` at a time.

    Within a chunk, with G the cumulative log decay from its start, the tokens' updates
    are a unit lower-triangular system (the UT transform): ``T U = beta * V`` gives the
    values each token writes before the incoming state is taken into account, and
    ``T W = beta * exp(G) * K`` how much of the incoming state each one reads back, where
    ``T = I + strictly_lower(beta_i k_i . k_j exp(G_i - G_j))``. Then, chunk by chunk:
    ``V' = U - W S``; the output is ``exp(G) Q S + (Q K^T * decay, causal) V'``; the state
    becomes ``exp(G_last) S + (exp(G_last - G) K)^T V'``."""
    length, heads, _ = key.shape
    pad = (-length) % chunk
    # [H, T', ...] with T' padded to whole chunks (padded tokens: zero k, v, decay, beta)
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (query, key, value))
    g, b = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (decay, beta))
    num_chunks = (length + pad) // chunk
    q, k, v = (x.reshape(heads, num_chunks, chunk, -1) for x in (q, k, v))
    g, b = (x.reshape(heads, num_chunks, chunk) for x in (g, b))
    cumulative = g.cumsum(-1)  # [H, C, L]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal: [H, C, L, L]
    pair_decay = (
        (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    )
    k_beta = k * b[..., None]
    lower = (k_beta @ k.transpose(-1, -2)) * pair_decay
    system = torch.linalg.solve_triangular  # (I + strictly_lower) X = rhs
    written = system(lower, v * b[..., None], upper=False, unitriangular=True)  # U
    reads = system(lower, k_beta * cumulative.exp()[..., None], upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pair_decay  # [H, C, L, L]
    q_decayed = q * cumulative.exp()[..., None]
    last = cumulative[..., -1:]  # [H, C, 1]
    k_to_end = k * (last - cumulative).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(num_chunks):
        values = written[:, c] - reads[:, c] @ state  # V': [H, L, Dv]
        out[:, c] = q_decayed[:, c] @ state + within[:, c] @ values
        state = state * last[:, c, :, None].exp() + k_to_end[:, c].transpose(-1, -2) @ values
    out = out.reshape(heads, num_chunks * chunk, -1)[:, :length].transpose(0, 1)
    return out, state
