"""Speculative decoding: verified drafts change how many steps a request takes, never its
tokens (greedy or seeded), its log-probs, its stops, or what it leaves behind.

Random-weight models do not repeat themselves, so the n-gram proposer rarely fires on
them; most tests therefore draft from a reference run (``ReplayProposer``), corrupting drafts at
a chosen rate so that steps accept all, some or none of them."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.speculative import ReplayProposer
from engine import LLM, LLMEngine, SamplingParams, StructuredOutput
from tests.engine.helpers import hf_greedy, random_prompts
from tests.engine.local_puller import LocalPuller
from tests.engine.test_disaggregation import disaggregated, run

VOCAB = 2000


def generate(engine: LLMEngine, prompts, params) -> dict[str, object]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return run(engine)


def tokens_of(outputs) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


PARAMS = {
    "greedy": SamplingParams(max_tokens=24, min_tokens=24, temperature=0),
    "seeded": SamplingParams(max_tokens=24, min_tokens=24, temperature=0.9, top_k=50, seed=3),
    # Per-position history: penalties and bad words see the drafts before them.
    "penalties+bad-words": SamplingParams(
        max_tokens=24, temperature=0.7, seed=5, repetition_penalty=1.3,
        frequency_penalty=0.5, presence_penalty=0.3, bad_words_token_ids=((11, 12), (40,)),
        logit_bias=((7, 3.0), (8, -2.0)), ignore_eos=True,
    ),
    "logprobs": SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True),
    # Eight allowed tokens: the recent ones repeat, so the drafts before a position change
    # its penalties and which bad word it completes.
    "history-greedy": SamplingParams(
        max_tokens=24, temperature=0, allowed_token_ids=list(range(20, 28)), ignore_eos=True,
        repetition_penalty=1.5, bad_words_token_ids=((20, 21), (22, 23), (24, 25, 26)),
    ),
    "history-seeded": SamplingParams(
        max_tokens=24, temperature=0.8, seed=11, allowed_token_ids=list(range(20, 28)),
        frequency_penalty=1.2, presence_penalty=0.5, bad_words_token_ids=((21, 20), (27, 27)),
        ignore_eos=True,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(lengths=(5, 17, 33, 64), seed=4)


@pytest.fixture(scope="module")
def references(tiny_llama, prompts) -> dict[str, dict]:
    engine = LLMEngine(tiny_llama)
    return {name: generate(engine, prompts, params) for name, params in PARAMS.items()}


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.parametrize("p_wrong", [0.0, 0.3, 1.0])
def test_drafts_never_change_the_output(tiny_llama, prompts, references, name, p_wrong):
    reference = references[name]
    engine = LLM(tiny_llama, num_speculative_tokens=4).engine
    engine.scheduler.proposer = ReplayProposer(tokens_of(reference), p_wrong, VOCAB)
    outputs = generate(engine, prompts, PARAMS[name])
    assert tokens_of(outputs) == tokens_of(reference)
    for rid, out in outputs.items():
        expected = reference[rid].outputs[0]
        assert out.outputs[0].finish_reason == expected.finish_reason
        if expected.logprobs is not None:
            for got, want in zip(out.outputs[0].logprobs, expected.logprobs, strict=True):
                assert got.token_id == want.token_id and got.rank == want.rank
                assert got.top_token_ids == want.top_token_ids
                assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    scheduler = engine.scheduler
    assert scheduler.num_draft_tokens > 0
    if p_wrong == 0.0:  # every draft kept: 1 + 4 tokens per step, after the prefill
        assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens
        assert engine.num_steps == 1 + -(-23 // 5)
    elif p_wrong == 1.0:
        assert scheduler.num_accepted_tokens == 0
    else:
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert engine.leak_report() == []


def test_greedy_with_drafts_matches_transformers(tiny_llama, prompts):
    expected = hf_greedy(tiny_llama, prompts, 20)
    engine = LLM(tiny_llama, num_speculative_tokens=3).engine
    reference = {f"r{i}": tokens for i, tokens in enumerate(expected)}
    engine.scheduler.proposer = ReplayProposer(reference, 0.25, VOCAB, seed=1)
    outputs = generate(engine, prompts, SamplingParams(max_tokens=20, min_tokens=20, temperature=0))
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert engine.scheduler.num_accepted_tokens > 0
    assert engine.leak_report() == []


def test_stops_and_limits_inside_accepted_drafts(tiny_llama, prompts, references):
    greedy = tokens_of(references["greedy"])
    engine = LLM(tiny_llama, num_speculative_tokens=6).engine
    engine.scheduler.proposer = ReplayProposer(greedy, 0.0, VOCAB)
    # A stop token in the middle of what the drafts would give: the request ends on it.
    stop_at = {rid: tokens[9] for rid, tokens in greedy.items()}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_at[rid],))
        engine.add_request(rid, prompt, params)
    outputs = run(engine)
    for rid, out in outputs.items():
        tokens = greedy[rid]
        end = tokens.index(stop_at[rid]) + 1
        assert out.outputs[0].token_ids == tokens[:end]
        assert (
            out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == tokens[end - 1]
        )
    # max_tokens binds exactly, whatever the number of drafts.
    for max_tokens in (1, 2, 5, 7, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = generate(engine, prompts, params)
        for rid, out in outputs.items():
            assert out.outputs[0].token_ids == greedy[rid][:max_tokens]
            assert out.outputs[0].finish_reason == "length"
    assert engine.leak_report() == []


def test_each_step_reports_the_tokens_it_added(tiny_llama, prompts, references):
    greedy = tokens_of(references["greedy"])
    engine = LLM(tiny_llama, num_speculative_tokens=4).engine
    engine.scheduler.proposer = ReplayProposer(greedy, 0.3, VOCAB, seed=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS["greedy"])
    streamed: dict[str, list[int]] = {rid: [] for rid in greedy}
    sizes = set()
    while engine.has_work():
        for output in engine.step():
            streamed[output.request_id] += output.new_token_ids
            sizes.add(len(output.new_token_ids))
    assert streamed == greedy
    assert max(sizes) > 1  # some steps added several tokens
    assert engine.leak_report() == []


def test_requests_that_cannot_verify_drafts_get_none(tiny_llama, prompts, references):
    greedy = tokens_of(references["greedy"])
    engine = LLM(tiny_llama, num_speculative_tokens=4).engine
    proposer = ReplayProposer(greedy, 0.0, VOCAB)
    engine.scheduler.proposer = proposer
    engine.add_request("r0", prompts[0], SamplingParams(max_tokens=8, temperature=0,
                       structured_output=StructuredOutput("regex", "[a-z ]{1,40}")))  # fmt: skip
    engine.add_request("r2", prompts[2], SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("r3", prompts[3], SamplingParams(max_tokens=8, temperature=0),
                       prefill_only=True)  # fmt: skip
    run(engine)
    # A grammar, one token to go, a prefill-only request: nothing to verify drafts for.
    assert proposer.asked == set()
    assert engine.release_kv("r3")
    engine.add_request("r1", prompts[1], SamplingParams(max_tokens=20, temperature=0))
    assert tokens_of(run(engine))["r1"][:2] == greedy["r1"][:2]
    assert proposer.asked == {"r1"}
    assert engine.leak_report() == []


def test_min_tokens_bans_hold_at_draft_positions(tiny_llama, prompts, references, tmp_path):
    # EOS set to the third token greedy decoding gives r0: before min_tokens, a draft's
    # position must ban it as a plain step does (the output then differs from the drafts'
    # reference there), and from min_tokens on allow it.
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_llama, model)
    generation_config = json.loads((model / "generation_config.json").read_text())
    eos = tokens_of(references["greedy"])["r0"][2]
    generation_config["eos_token_id"] = [eos]
    (model / "generation_config.json").write_text(json.dumps(generation_config))
    params = SamplingParams(max_tokens=20, min_tokens=6, temperature=0)
    expected = tokens_of(generate(LLMEngine(model), prompts, params))
    assert expected["r0"][2] != eos
    engine = LLM(model, num_speculative_tokens=4).engine
    engine.scheduler.proposer = ReplayProposer(expected, 0.0, VOCAB)
    assert tokens_of(generate(engine, prompts, params)) == expected
    assert engine.scheduler.num_accepted_tokens > 0
    assert engine.leak_report() == []


def test_the_ngram_proposer_in_the_engine(tiny_llama, prompts):
    # Few allowed tokens make the model loop, which is what n-gram lookup predicts.
    params = SamplingParams(max_tokens=40, temperature=0, allowed_token_ids=[20, 21, 22, 23],
                            ignore_eos=True)  # fmt: skip
    plain = LLMEngine(tiny_llama)
    expected = tokens_of(generate(plain, prompts, params))
    engine = LLM(tiny_llama, num_speculative_tokens=5, prompt_lookup_min=2).engine
    assert tokens_of(generate(engine, prompts, params)) == expected
    assert engine.scheduler.num_accepted_tokens > 0
    assert engine.num_steps < plain.num_steps * 0.9
    assert engine.leak_report() == []


def test_drafts_under_memory_pressure(tiny_llama, references):
    # 24 blocks of 16 tokens; drafts need slots too, and fall back to plain decoding (or
    # preempt) when there are none.
    prompts = random_prompts(lengths=(40, 57, 63, 70, 90), seed=8)
    params = SamplingParams(max_tokens=30, min_tokens=30, temperature=0.8, seed=9)
    expected = tokens_of(generate(LLMEngine(tiny_llama), prompts, params))
    engine = LLM(tiny_llama, num_speculative_tokens=6, num_blocks=24, max_model_len=256,
                 max_num_batched_tokens=64).engine  # fmt: skip
    engine.scheduler.proposer = ReplayProposer(expected, 0.2, VOCAB, seed=3)
    assert tokens_of(generate(engine, prompts, params)) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_accepted_tokens > 0
    assert engine.leak_report() == []


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_disaggregated_decode_with_drafts_equals_colocated(tiny_llama, prompts, references, name):
    reference = tokens_of(references[name])
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama)
    decode = LLM(tiny_llama, num_speculative_tokens=4).engine
    decode.kv_puller = puller
    decode.scheduler.proposer = ReplayProposer(reference, 0.3, VOCAB, seed=4)
    puller.sources["prefill-0"] = prefill
    puller.target = decode
    outputs = disaggregated(prefill, decode, prompts, PARAMS[name])
    assert tokens_of(outputs) == reference
    assert decode.scheduler.num_accepted_tokens > 0
    assert prefill.leak_report() == [] and decode.leak_report() == []
