"""Sampling settings keep lists the sampler goes over at every step free of repeats (a
request repeating one allowed id four million times slowed every batch it joined)."""

from __future__ import annotations

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
