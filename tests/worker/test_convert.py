"""Sampling parameters cross the router -> worker boundary whole: every field set away
from its default comes back equal from its proto."""

from __future__ import annotations

from dataclasses import fields

from common.structured_output import StructuredOutput
from engine.sampling_params import SamplingParams
from worker.convert import sampling_from_proto, sampling_to_proto


def test_every_sampling_field_round_trips_through_the_proto():
    structured = StructuredOutput("regex", "[a-z]+", "<think>", "</think>",
                                  reasoning_optional=True)  # fmt: skip
    params = SamplingParams(
        max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.75, top_k=3, seed=11,
        stop_token_ids=(4, 5), ignore_eos=True, logprobs=2, prompt_logprobs=1,
        presence_penalty=0.25, frequency_penalty=-0.5, repetition_penalty=1.25, min_p=0.125,
        logit_bias={3: 1.5}, allowed_token_ids=(1, 2, 3), bad_words_token_ids=((6, 7),),
        structured_output=structured,
    )  # fmt: skip
    defaults = SamplingParams()
    unset = [f.name for f in fields(SamplingParams)
             if getattr(params, f.name) == getattr(defaults, f.name)]  # fmt: skip
    assert unset == []  # the test covers every field
    assert sampling_from_proto(sampling_to_proto(params)) == params
    for name in ("reasoning_start", "reasoning_end", "reasoning_optional"):
        assert getattr(StructuredOutput("json", "{}"), name) != getattr(structured, name)
