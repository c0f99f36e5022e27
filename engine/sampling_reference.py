"""The sampler's semantics, one row and one position at a time: the oracle that the
batched ``engine.sampler.sample`` is held to token for token (tests), and the baseline of
``benchmarks/sampler.py``. Plain and slow on purpose: each rule is a few lines on one
``[V]`` row, in the order vLLM applies them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from engine.penalties import apply_penalties
from engine.request import TokenLogprobs
from engine.sampler import SamplingRow


def sample_reference(
    logits: torch.Tensor,  # [num_positions, vocab] float32: every row's positions, in order
    rows: Sequence[SamplingRow],
) -> list[list[tuple[int, TokenLogprobs | None]]]:
    """``engine.sampler.sample``, one position at a time."""
    first_positions = list(itertools.accumulate((row.num_positions for row in rows), initial=0))
    assert logits.shape[0] == first_positions[-1]
    vocab_size = logits.shape[1]
    owners = [(r, j) for r, row in enumerate(rows) for j in range(row.num_positions)]
    want_logprobs = [p for p, (r, _) in enumerate(owners) if rows[r].params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(-1) if want_logprobs else None
    logprobs_row = {p: i for i, p in enumerate(want_logprobs)}  # position -> raw_logprobs row
    for p, (r, j) in enumerate(owners):
        row = rows[r]
        banned = row.banned_token_ids
        if len(row.output_token_ids) + j >= row.params.min_tokens:
            banned = frozenset()
        if row.grammar_allowed is not None and j == 0:
            logits[p] = logits[p].masked_fill(~row.grammar_allowed.to(logits.device),
                                              float("-inf"))  # fmt: skip
        grammar_only = None
        if row.grammar_allowed is not None and (
            banned or row.params.allowed_token_ids or row.params.bad_words_token_ids
        ):
            grammar_only = logits[p].clone()  # what to fall back to (below)
        if banned:
            logits[p, list(banned)] = float("-inf")
        if row.params.allowed_token_ids is not None:
            _keep_only(logits[p], row.params.allowed_token_ids)
        if row.params.bad_words_token_ids:
            _ban_bad_words(logits[p], row.params.bad_word_bans(row.history(j)))
        if grammar_only is not None and not bool(torch.isfinite(logits[p]).any()):
            logits[p] = grammar_only  # the grammar outranks the rest (SamplingParams)
        if row.params.logit_bias:
            ids, biases = zip(*row.params.logit_bias, strict=True)
            logits[p, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        if row.params.has_penalties:
            assert row.token_counts is not None
            counts = row.token_counts
            counts.update(row.prompt_token_ids, row.output_token_ids, vocab_size, logits.device)
            apply_penalties(logits[p], row.params, counts, row.draft_token_ids[:j])
    greedy_ids = logits.argmax(-1).tolist()
    results: list[list[tuple[int, TokenLogprobs | None]]] = []
    for r, row in enumerate(rows):
        params = row.params
        tokens: list[tuple[int, TokenLogprobs | None]] = []
        for j in range(row.num_positions):
            p = first_positions[r] + j
            if params.greedy:
                token_id = greedy_ids[p]
            else:
                assert row.random is not None
                scaled = logits[p] / params.temperature
                if params.min_p > 0.0:
                    scaled = _apply_min_p(scaled, params.min_p)
                scaled = _apply_top_k_top_p(scaled, params.top_k, params.top_p)
                probs = scaled.softmax(-1)
                generator = row.random.for_token(len(row.output_token_ids) + j)
                token_id = int(torch.multinomial(probs, 1, generator=generator))
            token_logprobs = None
            if raw_logprobs is not None and params.logprobs is not None:
                token_logprobs = _logprobs_for(
                    raw_logprobs[logprobs_row[p]], token_id, params.logprobs
                )
            tokens.append((token_id, token_logprobs))
            if j == len(row.draft_token_ids) or token_id != row.draft_token_ids[j]:
                break
        results.append(tokens)
    return results


def _keep_only(logits: torch.Tensor, token_ids: Sequence[int]) -> None:
    """Mask (to -inf, in place) every token but ``token_ids``. logits: [V]."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[list(token_ids)] = True
    logits.masked_fill_(~keep, float("-inf"))


def _ban_bad_words(logits: torch.Tensor, token_ids: list[int]) -> None:
    """Mask ``token_ids`` (in place) unless that leaves nothing to sample (allowed token
    ids that are all bad words' last tokens at this step): then the bans yield, as a
    sequence must go on. logits: [V]."""
    if not token_ids:
        return
    saved = logits[token_ids].clone()
    logits[token_ids] = float("-inf")
    if not bool(torch.isfinite(logits).any()):
        logits[token_ids] = saved


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
