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

Speculative decoding: a row with draft tokens owns ``1 + len(draft_token_ids)`` logits
rows; position ``j`` is the distribution after the request's tokens and its first ``j``
drafts, processed with that history (bad words, penalties) and drawn with output token
``i + j``'s generator. The row yields the token sampled at each position for as long as
the drafts agree with them: a draft is kept iff it is the very token sampled at its
position, and the first token that differs (or the one after the last draft) ends the
row. So speculation changes how many steps a request takes, never its tokens: greedy, or
seeded, they are the tokens it would have drawn one step at a time. (For a draft that is
one token, not a distribution, this is also the standard speculative-sampling rule: the
draft is kept with probability p(draft), and otherwise the token comes from p without it.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.penalties import TokenCounts, apply_penalties
from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams

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


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    random: RequestRandom | None  # non-greedy requests: their random stream
    # Banned at the positions before params.min_tokens output tokens (EOS, stop tokens).
    banned_token_ids: frozenset[int]
    # The request's tokens so far (the output's length is the index of the row's first
    # token), and their counts (penalised requests).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    token_counts: TokenCounts | None = None
    # Structured requests: the tokens their grammar allows now ([vocab] bool, any device).
    grammar_allowed: torch.Tensor | None = None
    # Tokens proposed after the first: one more logits row each (module docstring).
    draft_token_ids: Sequence[int] = ()

    @property
    def num_positions(self) -> int:
        return 1 + len(self.draft_token_ids)

    def history(self, position: int) -> Sequence[int]:
        """The output tokens before ``position`` of the row, drafts included."""
        if not position:
            return self.output_token_ids
        return [*self.output_token_ids, *self.draft_token_ids[:position]]


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


def _apply_grammars(
    logits: torch.Tensor, rows: Sequence[SamplingRow], first_positions: Sequence[int]
) -> None:
    """Mask (in place) what each structured row's grammar does not allow: every row's
    mask in one host-to-device copy and one masked fill. logits: [num_positions, V].
    Structured rows have no drafts (``Request.may_speculate``)."""
    structured = [r for r, row in enumerate(rows) if row.grammar_allowed is not None]
    if not structured:
        return
    assert not any(rows[r].draft_token_ids for r in structured)
    indices = [first_positions[r] for r in structured]
    allowed = torch.stack([rows[r].grammar_allowed for r in structured]).to(logits.device)
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


def score_passes(num_rows: int) -> list[range]:
    """The rows each logits pass of ``score_tokens`` covers: a long prompt's logits at
    once would be prompt x vocab."""
    return [
        range(begin, min(begin + SCORE_ROWS_PER_PASS, num_rows))
        for begin in range(0, num_rows, SCORE_ROWS_PER_PASS)
    ]


def score_tokens(
    logits_passes: Iterator[torch.Tensor],  # [rows, vocab] for each of score_passes, in order
    target_token_ids: Sequence[int],  # the token each row's logits score
    num_top: int,
) -> list[TokenLogprobs]:
    """Log-probs (raw distribution) of ``target_token_ids`` after each row, one pass of
    ``score_passes`` at a time."""
    scored: list[TokenLogprobs] = []
    for rows in score_passes(len(target_token_ids)):
        logprobs = next(logits_passes).float().log_softmax(-1)  # [rows, vocab]
        targets = torch.tensor(target_token_ids[rows.start : rows.stop], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])  # [rows, 1]
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        top = torch.topk(logprobs, num_top) if num_top else None
        top_ids = top.indices.tolist() if top is not None else [[]] * len(rows)
        top_values = top.values.tolist() if top is not None else [[]] * len(rows)
        for j, (token_id, logprob) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(),
                                                    strict=True)):  # fmt: skip
            scored.append(TokenLogprobs(token_id, logprob, ranks[j], tuple(top_ids[j]),
                                        tuple(top_values[j])))  # fmt: skip
    return scored


def sample(
    logits: torch.Tensor,  # [num_positions, vocab] float32: every row's positions, in order
    rows: Sequence[SamplingRow],
) -> list[list[tuple[int, TokenLogprobs | None]]]:
    """Each row's tokens: one, or with drafts, the kept drafts and one more (module
    docstring), each with its log-probs when the row asks for them."""
    first_positions = list(itertools.accumulate((row.num_positions for row in rows), initial=0))
    assert logits.shape[0] == first_positions[-1]
    vocab_size = logits.shape[1]
    owners = [(r, j) for r, row in enumerate(rows) for j in range(row.num_positions)]
    want_logprobs = [p for p, (r, _) in enumerate(owners) if rows[r].params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(-1) if want_logprobs else None
    logprobs_row = {p: i for i, p in enumerate(want_logprobs)}  # position -> raw_logprobs row
    _apply_grammars(logits, rows, first_positions)
    for p, (r, j) in enumerate(owners):
        row = rows[r]
        banned = row.banned_token_ids
        if len(row.output_token_ids) + j >= row.params.min_tokens:
            banned = frozenset()
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
