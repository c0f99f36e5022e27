"""Sampling settings keep lists the sampler goes over at every step free of repeats (a
request repeating one allowed id four million times slowed every batch it joined)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import SamplingParams


def test_repeated_ids_and_words_are_kept_once_in_their_order():
    params = SamplingParams(
        allowed_token_ids=[7, 3, 7, 7, 3, 9],
        stop_token_ids=[2, 2, 5, 2],
        bad_words_token_ids=[[4, 5], [6], [4, 5], [6]],
    )
    assert params.allowed_token_ids == (7, 3, 9)
    assert params.stop_token_ids == (2, 5)
    assert params.bad_words_token_ids == ((4, 5), (6,))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logprobs": 1.5}, "logprobs"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_counts_are_integers_and_the_rest_numbers(kwargs, param):
    """Past the range checks, ``logprobs=1.5`` or ``top_k=2.5`` failed inside a step
    (taking the requests batched with it down), ``max_tokens=2.5`` gave 3 tokens."""
    with pytest.raises(InvalidSamplingParamsError) as error:
        SamplingParams(**kwargs)
    assert error.value.param == param and isinstance(error.value, ValueError)


def test_numpy_counts_are_integers():
    params = SamplingParams(max_tokens=np.int64(3), seed=np.int32(7), temperature=np.float32(0.5),
                            ignore_eos=np.bool_(True))  # fmt: skip
    assert (type(params.max_tokens), type(params.seed)) == (int, int)
    assert params.ignore_eos is True


def _naive_bans(words, output):
    """Every word checked against the output's end (the sampler's way until 2026-12-02)."""
    bans = []
    for word in words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and (not prefix or list(output[-len(prefix) :]) == prefix):
            bans.append(word[-1])
    return sorted(bans)


def test_bad_word_bans_are_every_word_whose_prefix_ends_the_output():
    rng = random.Random(3)
    for _ in range(300):
        words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(8)]
        params = SamplingParams(bad_words_token_ids=words)
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        assert sorted(params.bad_word_bans(output)) == _naive_bans(params.bad_words_token_ids,
                                                                   output)  # fmt: skip


def test_many_long_bad_words_cost_a_step_little():
    """4096 words of 60 tokens (a request's allowance is 4096 words of 256 characters):
    checking each at every step took ~13 ms a sequence, and 16 such sequences stalled
    their decode worker past the router's patience. 1000 steps now take well under a
    second of CPU (the per-word loop: ~13 s)."""
    rng = random.Random(0)
    words = [[rng.randrange(50_000) for _ in range(60)] for _ in range(4096)]
    words[7][-2] = 11  # one prefix ends with the output's last token
    params = SamplingParams(bad_words_token_ids=words)
    output = [rng.randrange(50_000) for _ in range(300)] + [11]
    start = time.process_time()
    for _ in range(1000):
        params.bad_word_bans(output)
    assert time.process_time() - start < 2.0
    assert params.bad_word_bans(output) == []
    assert params.bad_word_bans([1, 2, *words[7][:-1]]) == [words[7][-1]]
