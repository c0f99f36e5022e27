"""Repetition, frequency and presence penalties, from token counts kept per request.

The counts are built once from the prompt and then grow by the tokens sampled since the
last step, so a penalised request costs O(new tokens + vocabulary) per step (vectorised)
instead of rebuilding them from its whole token list (O(prompt + output) in Python).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


class TokenCounts:
    """One request's seen tokens (prompt and output) and output token counts, on the
    logits' device. Lives on the request; allocated at its first penalised step."""

    __slots__ = ("num_counted", "output_counts", "seen")

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or the output
        self.output_counts: torch.Tensor | None = None  # [V] int32: times in the output
        self.num_counted = 0  # output tokens already in the counts

    def update(
        self,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        if self.seen is None or len(output_token_ids) < self.num_counted:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
            self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            self.num_counted = 0
        assert self.output_counts is not None
        new = output_token_ids[self.num_counted :]
        if new:
            ids = torch.tensor(list(new), dtype=torch.long, device=device)
            self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            self.seen[ids] = True
            self.num_counted = len(output_token_ids)


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    counts: TokenCounts,
    extra_output_ids: Sequence[int] = (),
) -> None:
    """Penalise, in place, the tokens ``counts`` has seen, as vLLM does. logits: [V].

    ``extra_output_ids``: output tokens after those counted (draft tokens a speculative
    position follows), counted for this call only: ``counts`` is left as it was."""
    assert counts.seen is not None and counts.output_counts is not None
    seen, output_counts = counts.seen, counts.output_counts
    if extra_output_ids:
        ids = torch.tensor(list(extra_output_ids), dtype=torch.long, device=logits.device)
        seen = seen.clone()
        seen[ids] = True
        output_counts = output_counts.clone()
        output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    if params.repetition_penalty != 1.0:
        penalty = params.repetition_penalty
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if params.frequency_penalty or params.presence_penalty:
        logits -= params.frequency_penalty * output_counts + params.presence_penalty * (
            output_counts > 0
        )
