"""Seeded sampling keyed by output position: the contract that lets a request continue on
another worker (disaggregated, or moved after a decode worker died) with no skip-ahead.
Logit bias, allowed token ids and bad words: applied before greedy and sampling, not to
log-probs."""

from __future__ import annotations

import random

import pytest
import torch

from engine.errors import InvalidSamplingParamsError
from engine.penalties import TokenCounts
from engine.sampler import SamplingRow, _apply_rules, _has_rules, sample
from engine.sampling_ops import (
    TOP_PREFIX,
    RequestRandom,
    apply_top_k_top_p,
    exponential_race,
    token_seed,
)
from engine.sampling_params import SamplingParams
from engine.sampling_reference import _apply_top_k_top_p, sample_reference


def test_token_seeds_are_splitmix64_and_pinned():
    """Prefill and decode workers (maybe of different versions during a rollout) must agree
    on it: SplitMix64's published first output from state 0, and a value of ours."""
    assert token_seed(0, 0) == 0xE220A8397B1DCDAF
    assert token_seed(7, 1) == 309689372594955804
    assert len({token_seed(seed, i) for seed in range(50) for i in range(50)}) == 2500


def stream(seed: int) -> RequestRandom:
    return RequestRandom(seed, torch.Generator())


def test_a_draw_depends_only_on_seed_position_and_distribution():
    """The same row at output position 7 draws one token, whatever the 7 tokens before
    were and whatever it is batched with (another worker resuming it, another batch)."""
    logits = torch.randn(5000)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    here = SamplingRow(params, stream(11), frozenset(), output_token_ids=[1, 2, 3, 4, 5, 6, 7])
    elsewhere = SamplingRow(params, stream(11), frozenset(), output_token_ids=[9] * 7)
    others = [
        SamplingRow(SamplingParams(temperature=0.5), stream(s), frozenset()) for s in range(5)
    ]
    alone = sample(logits.clone()[None], [here])[0][0][0]
    batch = torch.cat([torch.randn(5, 5000), logits[None]])
    assert sample(batch, [*others, elsewhere])[5][0][0] == alone


def test_the_draw_is_torch_multinomials_so_seeded_outputs_never_changed():
    """Each row's token is what ``torch.multinomial`` with the row's seeded generator
    draws (the engine drew row by row with it before the sampler was batched)."""
    probs = torch.randn(8, 3000).mul(2).softmax(-1)
    probs[3, 100:] = 0.0  # zero mass is never drawn
    for index in range(5):
        expected = [int(torch.multinomial(probs[r], 1, generator=stream(r).for_token(index)))
                    for r in range(8)]  # fmt: skip
        draws = [(stream(seed), index) for seed in range(8)]
        assert exponential_race(probs, draws).tolist() == expected
        assert expected[3] < 100


def test_a_rescaled_distribution_draws_the_same_tokens():
    """A softmax normaliser rounded differently (a recompute after a migration) scales
    every probability alike; the race's argmax does not move. (An inverse CDF, tried
    first, moves every boundary: it flipped seeded tokens in migrated runs.)"""
    probs = torch.randn(64, 2048).softmax(-1)
    scaled = probs * (1 + 5e-6)
    tokens = [exponential_race(p, [(stream(s), 0) for s in range(64)]) for p in (probs, scaled)]
    assert torch.equal(*tokens)


def test_draws_follow_the_distribution():
    """4,000 positions of one seeded row: each token's frequency within 4 standard
    deviations of its probability (an off-by-one in the draw moves them far further)."""
    probs = torch.tensor([0.5, 0.05, 0.3, 0.0, 0.15])
    logits = probs.log()
    row = SamplingRow(SamplingParams(temperature=1.0), stream(123), frozenset())
    counts = [0] * 5
    for index in range(4000):
        row.output_token_ids = [0] * index
        counts[sample(logits.clone()[None], [row])[0][0][0]] += 1
    for count, p in zip(counts, probs.tolist(), strict=True):
        sd = (4000 * p * (1 - p)) ** 0.5
        assert abs(count - 4000 * p) <= 4 * sd + 1, counts


@pytest.mark.parametrize("scale", [8.0, 0.3])  # peaked: nucleus in the prefix; flat: not
def test_top_k_top_p_equal_a_whole_sort_of_each_row(scale):
    vocab = 3 * TOP_PREFIX
    logits = torch.randn(40, vocab, dtype=torch.float64).float() * scale
    logits[5, :] = 1.0  # all tied
    logits[6, : TOP_PREFIX + 10] = 2.0  # ties with the k-th value past the prefix
    rng = random.Random(0)
    top_k = [rng.choice([0, -1, 1, 5, 50, TOP_PREFIX + 7, vocab]) for _ in range(40)]
    top_p = [rng.choice([1.0, 0.5, 0.9, 0.99]) for _ in range(40)]
    top_k[6], top_p[6] = 3, 1.0
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for i in range(40):
        expected = _apply_top_k_top_p(logits[i].clone(), top_k[i], top_p[i])
        assert torch.equal(torch.isinf(masked[i]), torch.isinf(expected)), (i, top_k[i], top_p[i])


def _mixed_rows(rng: random.Random, vocab: int) -> list[SamplingRow]:
    """Rows with every rule the sampler applies, in random combinations."""
    rows = []
    for _ in range(24):
        kind = rng.random()
        fields: dict = {"max_tokens": 50}
        if kind < 0.3:
            fields["temperature"] = 0.0
        else:
            fields["temperature"] = rng.choice([0.3, 1.0, 1.7])
            fields["top_p"] = rng.choice([1.0, 1.0, 0.8, 0.95])
            fields["top_k"] = rng.choice([0, 0, 3, 40, TOP_PREFIX + 1])
            fields["min_p"] = rng.choice([0.0, 0.0, 0.05])
        if rng.random() < 0.3:
            fields["min_tokens"] = 10
            fields["stop_token_ids"] = [rng.randrange(vocab) for _ in range(3)]
        if rng.random() < 0.2:
            fields["allowed_token_ids"] = tuple(rng.sample(range(vocab), 6))
        if rng.random() < 0.3:
            fields["bad_words_token_ids"] = [[rng.randrange(vocab)] for _ in range(2)] + [
                [7, rng.randrange(vocab)]
            ]
        if rng.random() < 0.3:
            fields["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
        if rng.random() < 0.25:
            fields["repetition_penalty"] = 1.3
            fields["frequency_penalty"] = 0.5
        if rng.random() < 0.3:
            fields["logprobs"] = rng.choice([0, 2, 5])
        params = SamplingParams(**fields)
        output = [rng.choice([7, rng.randrange(vocab)]) for _ in range(rng.randrange(15))]
        banned = (
            frozenset(params.stop_token_ids) if len(output) < params.min_tokens else frozenset()
        )
        grammar = None
        drafts: list[int] = []
        if rng.random() < 0.15 and params.allowed_token_ids is None:
            grammar = torch.rand(vocab) < 0.3
        elif rng.random() < 0.3:
            drafts = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        rows.append(
            SamplingRow(
                params,
                None if params.greedy else stream(rng.getrandbits(64)),
                banned,
                [rng.randrange(vocab) for _ in range(5)],
                output,
                TokenCounts() if params.has_penalties else None,
                grammar,
                drafts,
            )
        )
    return rows


@pytest.mark.parametrize("scale", [6.0, 0.5])
def test_the_batched_sampler_equals_the_per_row_reference(scale):
    """Every rule at once over a batch of mixed rows (drafts included): token for token,
    log-probs included, what the per-row oracle gives."""
    vocab = 2 * TOP_PREFIX + 100
    rng = random.Random(int(scale * 10))
    for _ in range(4):
        rows = _mixed_rows(rng, vocab)
        logits = torch.randn(sum(row.num_positions for row in rows), vocab) * scale
        first = sample_reference(logits.clone(), rows)
        for row, tokens in zip(rows, first, strict=True):  # drafts kept past the first
            if row.draft_token_ids:
                row.draft_token_ids[0] = tokens[0][0]
        expected = sample_reference(logits.clone(), rows)
        assert any(len(tokens) > 1 for tokens in expected)
        got = sample(logits.clone(), rows)
        assert got == expected


@pytest.mark.parametrize("scale", [6.0, 0.5])
def test_a_step_without_drafts_equals_the_reference_too(scale):
    """The path a batch without drafts takes (one position per row), rules on some rows
    and none on others."""
    vocab = 2 * TOP_PREFIX + 100
    rng = random.Random(int(scale * 100))
    for _ in range(4):
        rows = _mixed_rows(rng, vocab)
        for row in rows:
            row.draft_token_ids = []
        assert any(_has_rules(row) for row in rows) and not all(map(_has_rules, rows))
        logits = torch.randn(len(rows), vocab) * scale
        assert sample(logits.clone(), rows) == sample_reference(logits.clone(), rows)


def test_rows_without_rules_are_left_alone_by_the_rule_stage():
    """``sample`` skips the rule stage when no row has a rule: each row ``_has_rules``
    calls free must be one the stage does not touch (a rule added to the stage and not to
    ``_has_rules`` fails here)."""
    vocab = 2 * TOP_PREFIX + 100
    rng = random.Random(7)
    rows = [row for _ in range(6) for row in _mixed_rows(rng, vocab)]
    free = [row for row in rows if not _has_rules(row)]
    ruled = [row for row in rows if _has_rules(row)]
    assert free and ruled
    assert all(torch.equal(_after_rules(row, vocab), _plain(row, vocab)) for row in free)
    # The stage does change rows with rules (the check above can fail).
    assert any(not torch.equal(_after_rules(row, vocab), _plain(row, vocab)) for row in ruled)


def _plain(row: SamplingRow, vocab: int) -> torch.Tensor:
    return torch.ones(row.num_positions, vocab)


def _after_rules(row: SamplingRow, vocab: int) -> torch.Tensor:
    logits = _plain(row, vocab)
    _apply_rules(logits, [row], [(0, j) for j in range(row.num_positions)])
    return logits


def draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> tuple[int, object]:
    row = SamplingRow(params, None if params.greedy else stream(seed), frozenset())
    ((token_id, logprobs),) = sample(logits.clone()[None], [row])[0]
    return token_id, logprobs


def test_logit_bias_moves_greedy_and_sampling_but_not_logprobs():
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    assert draw(logits, greedy)[0] == 1
    biased, logprobs = draw(logits, SamplingParams(temperature=0.0, logprobs=1,
                                                   logit_bias={1: -2.0, 3: 0.5}))  # fmt: skip
    assert biased == 2  # 5 - 2 < 4
    assert logprobs.logprob == pytest.approx(float(logits.log_softmax(-1)[2]))  # raw
    # +100 makes a token all but certain at temperature 1, -100 all but impossible.
    for seed in range(20):
        assert draw(logits, SamplingParams(temperature=1.0, logit_bias={0: 100.0}), seed)[0] == 0
        banned = SamplingParams(temperature=1.0, logit_bias={1: -100.0, 2: -100.0})
        assert draw(logits, banned, seed)[0] in (0, 3)


def test_allowed_token_ids_are_the_only_ones_sampled():
    logits = torch.randn(50)
    allowed = (3, 17, 41)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    assert draw(logits, greedy)[0] == max(allowed, key=lambda t: logits[t])
    drawn = {draw(logits, SamplingParams(temperature=2.0, allowed_token_ids=allowed), s)[0]
             for s in range(60)}  # fmt: skip
    assert drawn == set(allowed)


def test_a_bad_words_last_token_is_banned_where_the_output_ends_with_the_rest():
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [1, 2, 3], [4, 3]])
    assert params.bad_word_bans([]) == [7]
    assert params.bad_word_bans([9, 1, 2]) == [7, 3]
    assert params.bad_word_bans([1, 2, 4]) == [7, 3]
    assert params.bad_word_bans([2, 1]) == [7]
    logits = torch.tensor([0.0, 0.0, 0.0, 9.0, 1.0, 0.0, 0.0, 8.0])
    row = SamplingRow(params, None, frozenset(), output_token_ids=[5, 4])
    assert sample(logits.clone()[None], [row])[0][0][0] == 4  # not 3 (after 4) nor 7
    row.output_token_ids = [5]
    assert sample(logits.clone()[None], [row])[0][0][0] == 3


def test_bad_words_yield_when_they_would_leave_nothing_to_sample():
    """Allowed ids that are all banned at this step: the sequence must go on."""
    params = SamplingParams(temperature=0.0, allowed_token_ids=(2, 3),
                            bad_words_token_ids=[[1, 2], [1, 3]])  # fmt: skip
    logits = torch.tensor([5.0, 4.0, 1.0, 2.0])
    row = SamplingRow(params, None, frozenset(), output_token_ids=[1])
    assert sample(logits.clone()[None], [row])[0][0][0] == 3
    row.output_token_ids = [0]
    assert sample(logits.clone()[None], [row])[0][0][0] == 3


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"allowed_token_ids": (1, -2)}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words"),
        ({"bad_words_token_ids": [[1, -1]]}, "bad_words"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ],
)
def test_bad_bias_and_allowed_ids_are_refused(bad, param):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**bad)
    assert info.value.param == param
    SamplingParams(repetition_penalty=20.0)  # any finite value above 0, as in vLLM
