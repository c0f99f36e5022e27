"""Pick each request's next token from its logits: the grammar, bans, allowed tokens, bad
words, logit bias and penalties, then greedy, or temperature / min-p / top-k / top-p
(vLLM's order).

The whole batch goes through each stage at once (``engine.sampling_ops``): a stage is a
fixed number of kernels (the draw's noise excepted: a launch per row, one generator each),
and a step makes a fixed number of host syncs (one; one more with top-k / top-p, and with
log-probs), whatever the batch. The per-row loop it replaced made a few kernel launches
and a host sync per row, and sorted each top-p row whole (``benchmarks/sampler.py``). Its
semantics are kept, row by row, in ``engine.sampling_reference``, the oracle the tests hold
this sampler to token for token.

A non-greedy request draws its i-th output token from its generator seeded anew with
``token_seed(seed, i)`` (``seed`` is the request's, or one from the engine's RNG when it has
none), by ``torch.multinomial``'s exponential race (``engine.sampling_ops``): a token
depends only on the seed, its position and its distribution, so a request continued on another
worker (the first token sampled by a prefill worker, or a sequence the router moved after
a decode worker died) draws exactly what it would have drawn in one place, with no
skip-ahead. Log-probs are of the raw distribution (before the grammar, bans, allowed
tokens, bad words, logit bias, penalties, temperature, min-p, top-k and top-p), like
vLLM's default.

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
Every position is drawn, then the row is cut where its drafts part: a position's token
depends on nothing but its own inputs, so this is what drawing them one by one gives.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.penalties import TokenCounts, apply_penalties_batched
from engine.request import TokenLogprobs
from engine.sampling_ops import RequestRandom, apply_min_p, apply_top_k_top_p, exponential_race
from engine.sampling_params import SamplingParams


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


CPU_PASS_BYTES = 1 << 22  # _passes: rows drawn at once on a CPU, in float64 bytes


def sample(
    logits: torch.Tensor,  # [num_positions, vocab] float32: every row's positions, in order
    rows: Sequence[SamplingRow],
) -> list[list[tuple[int, TokenLogprobs | None]]]:
    """Each row's tokens: one, or with drafts, the kept drafts and one more (module
    docstring), each with its log-probs when the row asks for them. ``logits`` is
    modified in place."""
    # Per-position Python is most of this function's host time at large batches: the
    # common step (no drafts, no rules) walks the rows once per list it builds.
    num_positions = [1 + len(row.draft_token_ids) for row in rows]
    speculating = len(num_positions) != sum(num_positions)
    first_positions = list(itertools.accumulate(num_positions, initial=0))
    assert logits.shape[0] == first_positions[-1]
    if speculating:
        owners = [(r, j) for r, count in enumerate(num_positions) for j in range(count)]
        row_params = [rows[r].params for r, _ in owners]
    else:
        owners = [(r, 0) for r in range(len(rows))]
        row_params = [row.params for row in rows]
    want_logprobs = [p for p, params in enumerate(row_params) if params.logprobs is not None]
    raw_logprobs = logits[want_logprobs].log_softmax(-1) if want_logprobs else None
    _apply_grammars(logits, rows, first_positions)
    if any(_has_rules(row) for row in rows):
        _apply_rules(logits, rows, owners)
    token_ids = logits.argmax(-1)  # [num_positions]: the greedy rows' tokens
    drawn = [p for p, params in enumerate(row_params) if not params.greedy]
    for part in _passes(drawn, logits):
        index = _index(part, logits.device)
        token_ids[index] = _draw(logits[index], [(rows[owners[p][0]], owners[p][1]) for p in part])
    logprobs = []
    if raw_logprobs is not None:
        num_top = [row_params[p].logprobs or 0 for p in want_logprobs]
        logprobs = _logprobs(raw_logprobs, token_ids[want_logprobs], num_top)
    chosen = token_ids.tolist()  # waits for the draws: the sync every step makes
    logprobs_at = dict(zip(want_logprobs, logprobs, strict=True))
    if not speculating:
        return [[(token_id, logprobs_at.get(r))] for r, token_id in enumerate(chosen)]
    results: list[list[tuple[int, TokenLogprobs | None]]] = []
    for r, row in enumerate(rows):
        tokens: list[tuple[int, TokenLogprobs | None]] = []
        for j in range(row.num_positions):
            p = first_positions[r] + j
            tokens.append((chosen[p], logprobs_at.get(p)))
            if j == len(row.draft_token_ids) or chosen[p] != row.draft_token_ids[j]:
                break
        results.append(tokens)
    return results


def _has_rules(row: SamplingRow) -> bool:
    """Whether ``_apply_rules`` has anything to do for the row at any of its positions."""
    params = row.params
    return (
        len(row.output_token_ids) < params.min_tokens
        or params.allowed_token_ids is not None
        or bool(params.bad_words_token_ids)
        or bool(params.logit_bias)
        or params.has_penalties
    )


def _apply_rules(
    logits: torch.Tensor, rows: Sequence[SamplingRow], owners: Sequence[tuple[int, int]]
) -> None:
    """In place, each stage over every position at once, in vLLM's order: bans before
    ``min_tokens``, allowed token ids, bad words (which yield where they would leave
    nothing), the grammar's fallback (it outranks those three), logit bias, penalties.
    logits: [num_positions, V]."""
    device = logits.device
    bans: tuple[list[int], list[int]] = ([], [])  # (position, token id) pairs
    allowed: tuple[list[int], list[int]] = ([], [])  # (index in allowed_positions, id)
    allowed_positions: list[int] = []
    bad: tuple[list[int], list[int], list[int]] = ([], [], [])  # + index in bad_positions
    bad_positions: list[int] = []
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    fallback: list[int] = []
    penalised: list[int] = []
    for p, (r, j) in enumerate(owners):
        row = rows[r]
        params = row.params
        banned = row.banned_token_ids if len(row.output_token_ids) + j < params.min_tokens else ()
        for token_id in banned:
            bans[0].append(p)
            bans[1].append(token_id)
        if params.allowed_token_ids is not None:  # (up to the vocabulary: no loop here)
            allowed[0].extend([len(allowed_positions)] * len(params.allowed_token_ids))
            allowed[1].extend(params.allowed_token_ids)
            allowed_positions.append(p)
        bad_words = params.bad_word_bans(row.history(j)) if params.bad_words_token_ids else []
        if bad_words:
            for token_id in bad_words:
                bad[0].append(p)
                bad[1].append(token_id)
                bad[2].append(len(bad_positions))
            bad_positions.append(p)
        if row.grammar_allowed is not None and (
            banned or params.allowed_token_ids or params.bad_words_token_ids
        ):
            fallback.append(p)
        for token_id, value in params.logit_bias:
            bias[0].append(p)
            bias[1].append(token_id)
            bias[2].append(value)
        if params.has_penalties:
            penalised.append(p)
    saved = logits[fallback].clone() if fallback else None
    if bans[0]:
        logits[_index(bans[0], device), _index(bans[1], device)] = float("-inf")
    if allowed_positions:
        keep = torch.zeros(len(allowed_positions), logits.shape[1], dtype=torch.bool,
                           device=device)  # fmt: skip
        keep[_index(allowed[0], device), _index(allowed[1], device)] = True
        index = _index(allowed_positions, device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if bad_positions:
        at = (_index(bad[0], device), _index(bad[1], device))
        before = logits[at]  # a copy (advanced indexing)
        logits[at] = float("-inf")
        alive = torch.isfinite(logits[_index(bad_positions, device)]).any(-1)
        logits[at] = torch.where(alive[_index(bad[2], device)], float("-inf"), before)
    if saved is not None:
        index = _index(fallback, device)
        alive = torch.isfinite(logits[index]).any(-1, keepdim=True)
        logits[index] = torch.where(alive, logits[index], saved)
    if bias[0]:
        values = torch.tensor(bias[2], dtype=logits.dtype, device=device)
        logits.index_put_((_index(bias[0], device), _index(bias[1], device)), values,
                          accumulate=True)  # fmt: skip
    if penalised:
        positions = [(rows[owners[p][0]], owners[p][1]) for p in penalised]
        for row, _ in positions:  # each request's counts grow by its new tokens
            assert row.token_counts is not None
            row.token_counts.update(row.prompt_token_ids, row.output_token_ids,
                                    logits.shape[1], device)  # fmt: skip
        at = dict(zip(penalised, positions, strict=True))
        for part in _passes(penalised, logits):
            index = _index(part, device)
            logits[index] = apply_penalties_batched(
                logits[index],
                [at[p][0].params for p in part],
                [at[p][0].token_counts for p in part],  # type: ignore[misc]
                [at[p][0].draft_token_ids[: at[p][1]] for p in part],
            )


def _draw(logits: torch.Tensor, positions: Sequence[tuple[SamplingRow, int]]) -> torch.Tensor:
    """Temperature, min-p, top-k / top-p, then each position's draw from its generator.
    logits: [n, V]; positions: (row, j) of each. Returns [n] int64."""
    device = logits.device
    params = [row.params for row, _ in positions]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    scaled = logits.div_(temperature[:, None])  # a copy of the step's rows (caller's)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
        scaled = apply_min_p(scaled, min_p)
    vocab = logits.shape[1]
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if cut:
        index = _index(cut, device)
        scaled[index] = apply_top_k_top_p(
            scaled[index], [params[i].top_k for i in cut], [params[i].top_p for i in cut]
        )
    draws = [(row.random, len(row.output_token_ids) + j) for row, j in positions]
    return exponential_race(scaled.softmax(-1), draws)  # type: ignore[arg-type]


def _passes(positions: list[int], logits: torch.Tensor) -> list[list[int]]:
    """``positions`` in the groups a stage takes at once (the draw, the penalties): all of
    them on a GPU (each stage a fixed number of kernels). On a CPU, groups of rows whose
    float64 working set fits in cache: there these stages are bound by memory traffic,
    and a pass over a whole [256, 32k] batch measured 2x slower than 16 rows at a time."""
    if logits.device.type != "cpu":
        return [positions] if positions else []
    size = max(1, CPU_PASS_BYTES // (8 * logits.shape[1]))
    return [positions[i : i + size] for i in range(0, len(positions), size)]


def _logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """The raw log-prob, rank and top ``num_top`` of each chosen token, in one pass.
    raw_logprobs: [n, V]; token_ids: [n]."""
    chosen = raw_logprobs.gather(1, token_ids[:, None])  # [n, 1]
    ranks = ((raw_logprobs > chosen).sum(-1) + 1).tolist()
    most = max(num_top)
    top = torch.topk(raw_logprobs, most) if most else None
    top_ids = top.indices.tolist() if top is not None else [[]] * len(num_top)
    top_values = top.values.tolist() if top is not None else [[]] * len(num_top)
    return [
        TokenLogprobs(token_id, logprob, rank, tuple(ids[:k]), tuple(values[:k]))
        for token_id, logprob, rank, ids, values, k in zip(
            token_ids.tolist(),
            chosen[:, 0].tolist(),
            ranks,
            top_ids,
            top_values,
            num_top,
            strict=True,
        )
    ]


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
