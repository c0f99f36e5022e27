"""Pick each request's next token from its logits: the grammar, bans, allowed tokens, bad
words, logit bias and penalties, then greedy, or temperature / min-p / top-k / top-p
(vLLM's order).

Each request samples with its own ``torch.Generator``, one row at a time, so a seeded
request draws the same tokens whatever it is batched with. The draw for its i-th output
token comes from that generator seeded anew with ``token_seed(seed, i)`` (``seed`` is the
request's, or one from the engine's RNG when it has none): a token depends only on the
seed, its position and its distribution, so a request continued on another worker (the
first token sampled by a prefill worker, or a sequence the router moved after a decode
worker died) draws exactly what it would have drawn in one place, with no skip-ahead.
Log-probs are of the raw distribution (before the grammar, bans, allowed tokens, bad words,
logit bias, penalties, temperature, min-p, top-k and top-p), like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    # Structured requests: the tokens their grammar allows now ([vocab] bool, any device).
    grammar_allowed: torch.Tensor | None = None


_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded ``seed``:
    SplitMix64 of the pair, so neighbouring positions and seeds get unrelated streams.
    Pure integer arithmetic, the same on every host (a wire-level contract between
    workers: a prefill and a decode worker must agree on it)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class RequestRandom:
    """A non-greedy request's random stream (see the module docstring)."""

    seed: int
    generator: torch.Generator

    def for_token(self, index: int) -> torch.Generator:
        """The generator, seeded for the request's output token ``index``."""
        self.generator.manual_seed(token_seed(self.seed, index))
        return self.generator


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


def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Mask (in place) what each structured row's grammar does not allow: every row's
    mask in one host-to-device copy and one masked fill. logits: [num_rows, V]."""
    indices = [i for i, row in enumerate(rows) if row.grammar_allowed is not None]
    if not indices:
        return
    allowed = torch.stack([rows[i].grammar_allowed for i in indices]).to(logits.device)  # [R, V]
    index = torch.tensor(indices, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


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


SCORE_ROWS_PER_PASS = 256  # bounds the [rows, vocab] float32 logits held at once


def score_tokens(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [num_rows, hidden_size]
    target_token_ids: Sequence[int],  # [num_rows]: the token each row's logits score
    num_top: int,
) -> list[TokenLogprobs]:
    """Log-probs (raw distribution) of ``target_token_ids`` after each row of ``hidden``,
    a slice of rows at a time: a long prompt's logits at once would be prompt x vocab."""
    scored: list[TokenLogprobs] = []
    for begin in range(0, len(target_token_ids), SCORE_ROWS_PER_PASS):
        end = min(begin + SCORE_ROWS_PER_PASS, len(target_token_ids))
        logprobs = compute_logits(hidden[begin:end]).float().log_softmax(-1)  # [rows, vocab]
        targets = torch.tensor(target_token_ids[begin:end], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])  # [rows, 1]
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        top = torch.topk(logprobs, num_top) if num_top else None
        top_ids = top.indices.tolist() if top is not None else [[]] * (end - begin)
        top_values = top.values.tolist() if top is not None else [[]] * (end - begin)
        for j, (token_id, logprob) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(),
                                                    strict=True)):  # fmt: skip
            scored.append(TokenLogprobs(token_id, logprob, ranks[j], tuple(top_ids[j]),
                                        tuple(top_values[j])))  # fmt: skip
    return scored


def sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    rows: Sequence[SamplingRow],
) -> list[tuple[int, TokenLogprobs | None]]:
    assert logits.shape[0] == len(rows)
    vocab_size = logits.shape[1]
    want_logprobs = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(-1) if want_logprobs else None
    _apply_grammars(logits, rows)
    for i, row in enumerate(rows):
        grammar_only = None
        if row.grammar_allowed is not None and (
            row.banned_token_ids or row.params.allowed_token_ids or row.params.bad_words_token_ids
        ):
            grammar_only = logits[i].clone()  # what to fall back to (below)
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
        if row.params.allowed_token_ids is not None:
            _keep_only(logits[i], row.params.allowed_token_ids)
        if row.params.bad_words_token_ids:
            _ban_bad_words(logits[i], row.params.bad_word_bans(row.output_token_ids))
        if grammar_only is not None and not bool(torch.isfinite(logits[i]).any()):
            logits[i] = grammar_only  # the grammar outranks the rest (SamplingParams)
        if row.params.logit_bias:
            ids, biases = zip(*row.params.logit_bias, strict=True)
            logits[i, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
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
