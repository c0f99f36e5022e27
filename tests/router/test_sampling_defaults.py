"""Request fields left unset take the checkpoint's generation_config.json defaults."""

from __future__ import annotations

import json

import pytest

from common.generation_config import GenerationDefaults
from router.protocol import ChatCompletionRequest
from router.state import sampling_params


def test_unset_fields_take_the_checkpoint_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "do_sample": True, "eos_token_id": [1, 2],
    }))  # fmt: skip
    defaults = GenerationDefaults.read(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    unset = sampling_params(ChatCompletionRequest(messages=messages), defaults, None, chat=True)
    assert (unset.temperature, unset.top_k, unset.min_p) == (pytest.approx(0.7), 20, 0.0)
    assert unset.top_p == pytest.approx(0.8) and unset.repetition_penalty == 1.05
    asked = ChatCompletionRequest(messages=messages, temperature=0, top_k=-1,
                                  repetition_penalty=1.0)  # fmt: skip
    given = sampling_params(asked, defaults, None, chat=True)
    assert (given.temperature, given.top_k, given.repetition_penalty) == (0.0, -1, 1.0)
    # No file (or no sampling keys in it): the API's own defaults.
    no_file = GenerationDefaults.read(tmp_path / "none")
    plain = sampling_params(ChatCompletionRequest(messages=messages), no_file, None, chat=True)
    fields = (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty)
    assert fields == (1.0, 1.0, 0, 1.0)


def test_values_equal_to_transformers_defaults_set_nothing(tmp_path):
    """As vLLM reads the file (transformers' to_diff_dict): an explicit top_k of 50 is the
    library default, not a request for top-k sampling."""
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "top_k": 50, "temperature": 1.0, "top_p": 0.9}))  # fmt: skip
    assert GenerationDefaults.read(tmp_path) == GenerationDefaults(top_p=0.9)


def test_a_top_p_too_small_for_float32_stays_a_nucleus_of_one(tmp_path):
    """top_p travels as a float32, where 1e-50 is 0, which the worker reads as unset (1.0,
    every token): it goes as the smallest normal float32 instead."""
    from worker.convert import sampling_from_proto

    defaults = GenerationDefaults.read(tmp_path)
    asked = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=1e-50)
    params = sampling_params(asked, defaults, None, chat=True)
    assert 0 < params.top_p < 1e-37
    assert sampling_from_proto(params).top_p == params.top_p


def test_max_new_tokens_limits_a_request_that_sets_no_max_tokens(tmp_path):
    """vLLM's ``get_max_tokens``: generation_config's ``max_new_tokens`` is the limit of a
    request without ``max_tokens`` (never more than the context leaves); a request's own
    limit wins. It was ignored: such a request ran to the end of the context."""
    from router.choices import build_choices
    from router.errors import APIError

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 10}))
    defaults = GenerationDefaults.read(tmp_path)
    assert defaults.max_tokens == 10
    messages = [{"role": "user", "content": "hi"}]

    def limit(body: ChatCompletionRequest, default: int | None, max_model_len: int = 100) -> int:
        sampling = sampling_params(body, defaults, None, chat=True)
        (choice,) = build_choices(
            "c", [[1, 2, 3]], 1, sampling, [], max_model_len, 16, lambda stop, prompt: None,
            default_max_tokens=default,
        )  # fmt: skip
        return choice.request.sampling.max_tokens

    unset = ChatCompletionRequest(messages=messages)
    assert limit(unset, defaults.max_tokens) == 10
    assert limit(unset, defaults.max_tokens, max_model_len=8) == 5  # what the context leaves
    assert limit(unset, None) == 97
    assert limit(ChatCompletionRequest(messages=messages, max_tokens=50), 10) == 50
    with pytest.raises(APIError, match="max_new_tokens") as error:
        limit(ChatCompletionRequest(messages=messages, min_tokens=20), 10)
    assert error.value.param == "min_tokens"
    for value in (0, -3, True, 2.5, "64"):
        (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": value}))
        assert GenerationDefaults.read(tmp_path).max_tokens is None
