"""How a linear-attention layer's recurrences run over a step's batch, whatever the
recurrence (the gated delta rule, ``gated_delta_net.py``; Mamba-2's SSM, ``mamba2.py``;
the causal convolution both put before it, ``causal_conv``).

A step's sequences come as ``LinearStep`` orders them: the single-token decodes first
(one step of the recurrence each, all of them in one call), then decodes verifying drafts
(one position at a time, all of them together, keeping the states after every token:
``VerifyPlan``), then prompt chunks (the recurrence's chunked form, one sequence at a
time). Each reads its states from the layer's pool at its slot (in float32, whatever the
pool keeps: ``engine.linear_state_dtype``) and writes them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.linear_state import LinearStep

Rows = slice | torch.Tensor
# (rows of the step, states [B, ...] of those rows' sequences) -> (outputs [B, ...], the
# states after the token)
OneToken = Callable[[Rows, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (rows of one sequence's chunk, its states [...]) -> (outputs [n, ...], states after it)
Chunk = Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_recurrence(
    pool: torch.Tensor,  # [num_slots, ...] the layer's states of this kind (any float dtype)
    step: LinearStep,
    out: torch.Tensor,  # [num_tokens, ...] written at every row
    one_token: OneToken,
    chunk: Chunk,
) -> None:
    """Run a step's rows through a recurrence: ``one_token`` for the decodes (all at once)
    and for the verifying decodes' positions (those at a position at once), ``chunk`` for
    each prompt chunk, updating the states in ``pool``. ``one_token`` is given copies of
    the states (gathered by slot), so it may update them in place; ``chunk`` may be given
    a view of the pool's and must not."""
    num_decodes = step.num_decodes
    if num_decodes:
        slots = step.slots[:num_decodes]
        out[:num_decodes], states = one_token(slice(0, num_decodes), pool[slots].float())
        pool[slots] = states.to(pool.dtype)
    plan = step.verify
    if plan is not None:  # a token and its drafts each: the states after every one kept
        current = pool[plan.slots].float()  # [B, ...] each verifying sequence's states
        for rows, active, kept in zip(plan.rows, plan.active, plan.kept, strict=True):
            every = len(active) == len(current)  # (as usual: all verify as many drafts)
            out[rows], states = one_token(rows, current if every else current[active])
            if every:
                current = states
            else:
                current[active] = states
            pool[kept] = states.to(pool.dtype)
    starts = step.query_start_loc_cpu
    for seq in range(num_decodes, len(starts) - 1):
        if step.verifies(seq):
            continue
        rows = slice(starts[seq], starts[seq + 1])
        slot = step.slots_cpu[seq]
        out[rows], states = chunk(rows, pool[slot].float())
        pool[slot] = states  # (cast to the pool's dtype by the copy)


def causal_conv(
    mixed: torch.Tensor,  # [N, C] the step's rows
    pool: torch.Tensor,  # [num_slots, C, K - 1]: each slot's last K - 1 inputs
    step: LinearStep,
    weight: torch.Tensor,  # [C, K] float32
    bias: torch.Tensor | None,  # [C] float32
) -> torch.Tensor:  # [N, C] float32, before the activation
    """A depthwise causal convolution of each sequence's rows, continuing from (and
    updating) its convolution state: the last ``K - 1`` inputs before them."""

    def one_token(rows: Rows, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.cat((states, mixed[rows, :, None].float()), -1)  # [B, C, K]
        convolved = (window * weight).sum(-1)
        return (convolved if bias is None else convolved + bias), window[..., 1:]

    def chunk(rows: slice, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.cat((state, mixed[rows].T.float()), -1)  # [C, K - 1 + n]
        convolved = F.conv1d(inputs[None], weight[:, None], bias, groups=weight.shape[0])[0]
        return convolved.T, inputs[:, inputs.shape[1] - state.shape[1] :]

    out = torch.empty(mixed.shape, dtype=torch.float32, device=mixed.device)
    run_recurrence(pool, step, out, one_token, chunk)
    return out
