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


def apply_penalties_batched(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    counts: Sequence[TokenCounts],
    extra_output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """``apply_penalties`` for many rows at once: a fixed number of kernels, however many
    rows (one launch each per row was the sampler's last per-row loop, and Qwen2.5's
    checkpoints set a repetition penalty for every request). Returns the penalised
    ``[rows, V]`` logits; row i with ``params[i]``, ``counts[i]`` and ``extra_output_ids[i]``
    as ``apply_penalties`` takes them. A penalty at its neutral value changes nothing
    bit for bit (x / 1, x * 1, x - 0), so rows need not be grouped by which they use."""
    device = logits.device
    seen = torch.stack([c.seen for c in counts])  # type: ignore[misc]  # [rows, V] bool
    output_counts = torch.stack([c.output_counts for c in counts])  # type: ignore[misc]
    extra_rows = [row for row, ids in enumerate(extra_output_ids) for _ in ids]
    if extra_rows:
        rows = torch.tensor(extra_rows, dtype=torch.long, device=device)
        ids = torch.tensor([t for ids in extra_output_ids for t in ids], dtype=torch.long,
                           device=device)  # fmt: skip
        seen[rows, ids] = True
        output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32),
                                 accumulate=True)  # fmt: skip

    def column(values: list[float]) -> torch.Tensor:  # [rows, 1]
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    repetition = column([p.repetition_penalty for p in params])
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    frequency = column([p.frequency_penalty for p in params])
    presence = column([p.presence_penalty for p in params])
    return logits - (frequency * output_counts + presence * (output_counts > 0))
