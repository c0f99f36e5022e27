"""Token counts kept a few tokens a step equal counts rebuilt from the whole token lists,
and the penalties computed from them equal the direct formula (vLLM's)."""

from __future__ import annotations

import torch

from engine.penalties import TokenCounts, apply_penalties
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
