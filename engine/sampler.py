"""Pick each request's next token from its logits: bans and penalties, then greedy, or
temperature / min-p / top-k / top-p (vLLM's order).

Each request samples with its own ``torch.Generator`` (seeded from its ``seed``, or from
the engine's seed when it has none), one row at a time, so a seeded request draws the same
tokens whatever it is batched with. Log-probs are of the raw distribution (before bans,
penalties, temperature, min-p, top-k and top-p), like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.penalties import TokenCounts, apply_penalties
from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: frozenset[int]
    # The request's tokens so far and their counts; read only when it has penalties.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    token_counts: TokenCounts | None = None


def _apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Mask tokens less likely than ``min_p`` x the likeliest. logits: [V], scaled."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k and the top-p nucleus. logits: [V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; keep at least one.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _logprobs_for(raw_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logprob = raw_logprobs[token_id]
    rank = int((raw_logprobs > logprob).sum()) + 1
    top = torch.topk(raw_logprobs, num_top) if num_top else None
    return TokenLogprobs(
        token_id=token_id,
        logprob=float(logprob),
        rank=rank,
        top_token_ids=tuple(top.indices.tolist()) if top is not None else (),
        top_logprobs=tuple(top.values.tolist()) if top is not None else (),
    )


def advance_generator(generator: torch.Generator, num_draws: int, vocab_size: int) -> None:
    """Consume the random numbers ``num_draws`` sampled tokens would have consumed.

    ``torch.multinomial`` draws the same amount of randomness for one sample from any
    distribution of a given size, so drawing from a uniform one advances the stream
    exactly as the real draws did."""
    if num_draws == 0:
        return
    uniform = torch.full((vocab_size,), 1.0 / vocab_size, device=generator.device)
    for _ in range(num_draws):
        torch.multinomial(uniform, 1, generator=generator)


def sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    rows: Sequence[SamplingRow],
) -> list[tuple[int, TokenLogprobs | None]]:
    assert logits.shape[0] == len(rows)
    vocab_size = logits.shape[1]
    want_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(-1) if want_logprobs else None
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
        if row.params.has_penalties:
            assert row.token_counts is not None
            counts = row.token_counts
            counts.update(row.prompt_token_ids, row.output_token_ids, vocab_size, logits.device)
            apply_penalties(logits[i], row.params, counts)
    greedy_ids = logits.argmax(-1).tolist()
    results: list[tuple[int, TokenLogprobs | None]] = []
    for i, row in enumerate(rows):
        params = row.params
        if params.greedy:
            token_id = greedy_ids[i]
        else:
            scaled = logits[i] / params.temperature
            if params.min_p > 0.0:
                scaled = _apply_min_p(scaled, params.min_p)
            scaled = _apply_top_k_top_p(scaled, params.top_k, params.top_p)
            probs = scaled.softmax(-1)
            token_id = int(torch.multinomial(probs, 1, generator=row.generator))
        token_logprobs = None
        if raw_logprobs is not None and params.logprobs is not None:
            token_logprobs = _logprobs_for(
                raw_logprobs[want_logprobs.index(i)], token_id, params.logprobs
            )
        results.append((token_id, token_logprobs))
    return results
