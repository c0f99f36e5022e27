"""Sampling settings keep lists the sampler goes over at every step free of repeats (a
request repeating one allowed id four million times slowed every batch it joined)."""

from __future__ import annotations

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
