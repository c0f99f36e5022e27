"""Seeded sampling keyed by output position: the contract that lets a request continue on
another worker (disaggregated, or moved after a decode worker died) with no skip-ahead.
Logit bias, allowed token ids and bad words: applied before greedy and sampling, not to
log-probs."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidSamplingParamsError
from engine.sampler import RequestRandom, SamplingRow, sample, token_seed
from engine.sampling_params import SamplingParams


def test_token_seeds_are_splitmix64_and_pinned():
    """Prefill and decode workers (maybe of different versions during a rollout) must agree
    on it: SplitMix64's published first output from state 0, and a value of ours."""
    assert token_seed(0, 0) == 0xE220A8397B1DCDAF
    assert token_seed(7, 1) == 309689372594955804
    assert len({token_seed(seed, i) for seed in range(50) for i in range(50)}) == 2500


def test_a_draw_depends_only_on_seed_position_and_distribution():
    probs = torch.softmax(torch.randn(5000), -1)
    here = RequestRandom(11, torch.Generator())
    for index in range(7):  # whatever was drawn before on this worker
        torch.multinomial(probs, 1, generator=here.for_token(index))
    elsewhere = RequestRandom(11, torch.Generator())  # another worker, resuming at 7
    draws = [int(torch.multinomial(probs, 1, generator=r.for_token(7))) for r in (here, elsewhere)]
    assert draws[0] == draws[1]


def draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> tuple[int, object]:
    random = RequestRandom(seed, torch.Generator())
    row = SamplingRow(params, None if params.greedy else random, frozenset())
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
    ],
)
def test_bad_bias_and_allowed_ids_are_refused(bad, param):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**bad)
    assert info.value.param == param
