"""Token counts kept a few tokens a step equal counts rebuilt from the whole token lists,
and the penalties computed from them equal the direct formula (vLLM's)."""

from __future__ import annotations

import torch

from engine.penalties import TokenCounts, apply_penalties, apply_penalties_batched
from engine.sampling_params import SamplingParams

VOCAB = 97


def _direct(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    """The penalties from the token lists, one formula per penalty."""
    logits = logits.clone()
    seen = torch.tensor(prompt + output).unique()
    values = logits[seen]
    penalty = params.repetition_penalty
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if output:
        token_ids, counts = torch.tensor(output).unique(return_counts=True)
        logits[token_ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def test_incremental_counts_give_the_direct_penalties():
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (40,), generator=generator).tolist()
    output: list[int] = []
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    counts = TokenCounts()
    for step in range(30):
        logits = torch.randn(VOCAB, generator=generator)
        counts.update(prompt, output, VOCAB, logits.device)
        expected = _direct(logits, params, prompt, output)
        apply_penalties(logits, params, counts)
        assert torch.equal(logits, expected), step
        # one token a step, and sometimes several (a disaggregated hand-off, a stop string
        # check that held tokens back)
        num_new = 3 if step % 7 == 0 else 1
        output += torch.randint(0, VOCAB, (num_new,), generator=generator).tolist()
    assert counts.num_counted == len(output) - num_new
    assert int(counts.output_counts.sum()) == counts.num_counted


def test_the_batched_penalties_equal_each_row_alone_bit_for_bit():
    """Rows with every mix of penalties (neutral ones included) and draft tokens counted
    for the call only: the same logits as ``apply_penalties`` row by row, and the counts
    left as they were."""
    generator = torch.Generator().manual_seed(1)
    settings = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.4, presence_penalty=-0.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=1.1, presence_penalty=0.2),
        SamplingParams(temperature=0.0, repetition_penalty=1.05),
    ]
    params, counts, drafts = [], [], []
    for row in range(12):
        prompt = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
        output = torch.randint(0, VOCAB, (row,), generator=generator).tolist()
        row_counts = TokenCounts()
        row_counts.update(prompt, output, VOCAB, torch.device("cpu"))
        params.append(settings[row % len(settings)])
        counts.append(row_counts)
        drafts.append(torch.randint(0, VOCAB, (row % 3,), generator=generator).tolist())
    logits = torch.randn(12, VOCAB, generator=generator) * 3
    logits[0, :5] = float("-inf")  # banned earlier in the step
    seen_before = [c.seen.clone() for c in counts]
    got = apply_penalties_batched(logits.clone(), params, counts, drafts)
    for row in range(12):
        expected = logits[row].clone()
        apply_penalties(expected, params[row], counts[row], drafts[row])
        assert torch.equal(got[row], expected), row
        assert torch.equal(counts[row].seen, seen_before[row])
