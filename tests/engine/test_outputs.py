"""Outputs read the request's lists without copying them: each output must go on saying
what it said when its step made it, through preemption, drafts and a resumed request."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, TokenLogprobs
from tests.engine.helpers import random_prompts


def snapshot(output: RequestOutput) -> tuple:
    completion = output.outputs[0]
    logprobs = completion.logprobs
    return (
        completion.token_ids,
        None if logprobs is None else [(lp.token_id, lp.logprob) for lp in logprobs],
        completion.num_tokens,
        list(output.new_token_ids),
        completion.finish_reason,
    )


def run_keeping_outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams, **kwargs):
    """Every output of every step, each beside what it held when the step returned it."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, **kwargs)
    kept: list[tuple[RequestOutput, tuple]] = []
    while engine.has_unfinished_requests():
        kept += [(output, snapshot(output)) for output in engine.step()]
    assert engine.leak_report() == []
    return kept


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_blocks": 12, "max_model_len": 160}, {"num_speculative_tokens": 3}],
    ids=["plain", "preempted", "drafts"],
)
def test_an_output_keeps_what_its_step_said(tiny_llama, overrides):
    llm = LLM(tiny_llama, **overrides)
    # Few allowed tokens make the model loop, which the n-gram proposer predicts.
    params = SamplingParams(max_tokens=20, min_tokens=20, temperature=0, logprobs=2,
                            allowed_token_ids=[20, 21, 22, 23])  # fmt: skip
    prompts = random_prompts((27, 51, 90, 123), seed=4)
    kept = run_keeping_outputs(llm, prompts, params)
    if "num_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    if "num_speculative_tokens" in overrides:
        assert llm.engine.scheduler.num_accepted_tokens > 0
    by_request: dict[str, list[tuple]] = {}
    for output, then in kept:
        assert snapshot(output) == then  # nothing after its step changed it
        by_request.setdefault(output.request_id, []).append(then)
    for steps in by_request.values():
        tokens: list[int] = []
        for token_ids, logprobs, num_tokens, new_token_ids, _ in steps:
            tokens += new_token_ids
            assert token_ids == tokens and num_tokens == len(tokens)
            assert logprobs is not None and [t for t, _ in logprobs] == tokens
        assert len(tokens) == 20 and steps[-1][4] == "length"


def test_a_resumed_request_counts_the_tokens_it_was_handed(tiny_llama):
    """Tokens handed in (a migrated request's) come without log-probs: they count, and
    ``last_logprobs`` gives only the log-probs of what this engine generated."""
    llm = LLM(tiny_llama)
    handed = [11, 12, 13]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logprobs=1)
    kept = run_keeping_outputs(llm, random_prompts((20,), seed=5), params, output_token_ids=handed)
    first, final = kept[0][0].outputs[0], kept[-1][0].outputs[0]
    assert first.token_ids[:3] == handed and first.num_tokens == 4
    assert [lp.token_id for lp in first.last_logprobs(5)] == first.token_ids[3:]
    assert final.num_tokens == 8 and len(final.logprobs or []) == 5
    assert [lp.token_id for lp in final.last_logprobs(2)] == final.token_ids[-2:]


def test_reads_copy_only_up_to_the_output_s_lengths():
    token_ids = [1, 2, 3]
    logprobs = [TokenLogprobs(t, -1.0, 1, (), ()) for t in token_ids]
    output = CompletionOutput(0, token_ids, 2, logprob_source=logprobs, num_logprobs=2)
    token_ids.append(4)
    logprobs.append(TokenLogprobs(4, -1.0, 1, (), ()))
    assert output.token_ids == [1, 2]
    assert [lp.token_id for lp in output.logprobs or []] == [1, 2]
    assert [lp.token_id for lp in output.last_logprobs(1)] == [2]
    assert output.last_logprobs(0) == [] and len(output.last_logprobs(9)) == 2
    output.token_ids.append(99)  # a read is the caller's own list
    assert token_ids == [1, 2, 3, 4]
    assert CompletionOutput(0, [5], 1).logprobs is None
    assert CompletionOutput(0, [5], 1).last_logprobs(1) == []


@pytest.mark.parametrize(
    "start,end", [(0, 3), (1, 5), (4, 7), (5, 7), (6, 8), (3, 4), (0, 9), (7, 9), (2, 2)]
)
def test_token_ids_between_equals_a_slice_of_the_whole_sequence(start, end):
    request = Request("r", [10, 11, 12, 13, 14], SamplingParams(), frozenset(), 64)
    request.output_token_ids += [20, 21, 22, 23]
    whole = request.prompt_token_ids + request.output_token_ids
    assert request.token_ids_between(start, end) == whole[start:end]


def test_prompt_logprobs_are_built_once_and_carried_by_every_later_output(tiny_llama):
    """Scored in 16-token chunks, then carried by every output: the same list (built once,
    not copied each step), all of it."""
    llm = LLM(tiny_llama, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=5, min_tokens=5, temperature=0, prompt_logprobs=1)
    prompt = random_prompts((40,), seed=6)[0]
    kept = run_keeping_outputs(llm, [prompt], params)
    carried = [output.prompt_logprobs for output, _ in kept]
    assert len(carried) == 5 and all(c is carried[0] for c in carried)
    assert carried[0] is not None and len(carried[0]) == 40 and carried[0][0] is None
    assert [lp.token_id for lp in carried[0][1:]] == prompt[1:]
