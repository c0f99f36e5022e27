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
    # The offline API's own fields (``engine/llm.py``): an engine request refuses them, so
    # they never travel.
    offline = {"n", "stop", "include_stop_str_in_output"}
    unset = [f.name for f in fields(SamplingParams)
             if getattr(params, f.name) == getattr(defaults, f.name)]  # fmt: skip
    assert set(unset) == offline  # the test covers every field
    assert sampling_from_proto(sampling_to_proto(params)) == params
    for name in ("reasoning_start", "reasoning_end", "reasoning_optional"):
        assert getattr(StructuredOutput("json", "{}"), name) != getattr(structured, name)


def test_prompt_logprobs_are_built_off_the_event_loop():
    """A long prompt's top-n log-probs took the worker's event loop for up to a second
    (no other call answered meanwhile): they are built on a thread, in prompt order, the
    leading None dropped."""
    import asyncio
    import threading

    from engine.outputs import RequestOutput
    from engine.request import TokenLogprobs
    from proto import pdserve_pb2 as pb
    from worker import convert
    from worker.convert import add_prompt_logprobs

    scored = [None] + [TokenLogprobs(i, -0.5 * i, 1, (i,), (-0.5 * i,)) for i in range(1, 5)]
    output = RequestOutput("r", [1, 2, 3, 4, 5], [], False, prompt_logprobs=scored)
    built_on: list[threading.Thread] = []
    original = convert.logprobs_to_proto

    def recorded(lp: TokenLogprobs) -> pb.TokenLogprobs:
        built_on.append(threading.current_thread())
        return original(lp)

    convert.logprobs_to_proto = recorded
    try:
        reply = pb.PrefillResponse()
        asyncio.run(add_prompt_logprobs(reply.prompt_logprobs, output))
    finally:
        convert.logprobs_to_proto = original
    assert [lp.token_id for lp in reply.prompt_logprobs] == [1, 2, 3, 4]
    assert built_on and threading.main_thread() not in built_on
