"""Structured outputs in the engine: every kind of constraint holds, greedy and sampled;
the constrained greedy token is transformers' best among the tokens the grammar allows; a
request resumed elsewhere (the decode side, a moved sequence) or preempted continues with
the same tokens; a complete grammar stops the request at once; bad constraints and
off-grammar replays are refused with nothing kept."""

from __future__ import annotations

import json
import re
import shutil
import sys

import jsonschema
import numpy as np
import pytest
import torch

from common.structured_output import JSON_OPTIONS, StructuredOutput
from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from engine.models.arch import read_arch_config
from tests.engine.helpers import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
NUMBER = "[1-9][0-9]{0,2}"
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe later", "maybe"]
LARK = 'start: NUMBER | "(" NUMBER OP NUMBER ")"\nOP: "+" | "-" | "*"\nNUMBER: /' + NUMBER + "/"
LARK_AS_REGEX = rf"{NUMBER}|\({NUMBER}[-+*]{NUMBER}\)"


def _valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CONSTRAINTS = {
    "json": (StructuredOutput("json", json.dumps(SCHEMA)), _valid_json),
    "regex": (StructuredOutput("regex", REGEX), lambda text: re.fullmatch(REGEX, text)),
    "choice": (StructuredOutput("choice", json.dumps(CHOICES)), lambda text: text in CHOICES),
    "grammar": (StructuredOutput("grammar", LARK), lambda t: re.fullmatch(LARK_AS_REGEX, t)),
}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts((6, 20, 40, 70), seed=31)


def _params(structured: StructuredOutput, **overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 64, "temperature": 0.0,
                             "structured_output": structured, **overrides})  # fmt: skip


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_outputs_match_their_constraint_greedy_and_sampled(llm, prompts, kind):
    structured, valid = CONSTRAINTS[kind]
    free = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    assert not any(valid(o.outputs[0].text) for o in free)  # the random model alone does not
    for params in (_params(structured), _params(structured, temperature=1.0, seed=5)):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for output in outputs:
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", completion
            assert valid(completion.text), completion.text
    assert llm.engine.leak_report() == []


def test_constrained_greedy_is_transformers_best_allowed_token(tiny_llama, llm, prompts):
    """An oracle outside the engine: transformers' logits and a matcher of our own; each
    greedy token must be the likeliest token the grammar allows at that point."""
    from llguidance import LLMatcher, LLTokenizer
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    structured = CONSTRAINTS["json"][0]
    served = llm.generate(prompts[:2], _params(structured), use_tqdm=False)
    arch = read_arch_config(tiny_llama)
    text = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).to_str()
    tokenizer = LLTokenizer(text, n_vocab=arch.vocab_size, eos_token=list(arch.eos_token_ids))
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for prompt, output in zip(prompts[:2], served, strict=True):
        matcher = LLMatcher(tokenizer, grammar)
        tokens = output.outputs[0].token_ids
        for step, token_id in enumerate(tokens):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens[:step]])).logits[0, -1]
            words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(words, bitorder="little")[: arch.vocab_size].astype(bool)
            logits[~torch.from_numpy(allowed)] = float("-inf")
            assert token_id == int(logits.argmax()), (step, tokens)
            assert matcher.consume_token(token_id)
        assert matcher.is_stopped()  # it stopped because the JSON was complete


@pytest.mark.parametrize("kind", ["json", "grammar"])
def test_a_resumed_or_preempted_request_continues_with_the_same_tokens(tiny_llama, llm, kind):
    """What the decode worker does after a prefill worker's first token, and what a moved
    sequence does: the grammar replays the tokens given, and sampling goes on unchanged."""
    structured = CONSTRAINTS[kind][0]
    prompts = random_prompts(
        (32, 48, 64, 80), seed=32
    )  # whole blocks: the next token needs one more
    for params in (_params(structured), _params(structured, temperature=1.0, seed=9)):
        whole = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for num_given in (1, 4):
            engine = llm.engine
            for i, prompt in enumerate(prompts):
                given = whole[i][: min(num_given, len(whole[i]) - 1)]
                engine.add_request(f"resume-{i}", prompt, params, output_token_ids=given)
            finished = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output.outputs[0].token_ids
            assert [finished[f"resume-{i}"] for i in range(len(prompts))] == whole
        # 9 blocks of 16 tokens cannot hold the batch at once: preemptions recompute.
        tight = LLM(tiny_llama, num_blocks=9, max_model_len=144)
        outputs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outputs] == whole
        assert tight.engine.leak_report() == []
    assert llm.engine.leak_report() == []


def test_a_complete_grammar_stops_whatever_min_tokens_and_ignore_eos(llm, prompts):
    structured = CONSTRAINTS["choice"][0]
    eos = llm.engine.eos_token_ids
    for extra in ({}, {"min_tokens": 30}, {"ignore_eos": True}):
        for output in llm.generate(prompts, _params(structured, **extra), use_tqdm=False):
            completion = output.outputs[0]
            assert completion.finish_reason == "stop" and completion.text in CHOICES
            if completion.text != "maybe":  # "maybe" may go on: the model chose EOS there
                assert not set(completion.token_ids) & eos  # no step spent on an EOS
    assert llm.engine.leak_report() == []


def test_a_prefill_whose_first_token_completes_the_grammar_holds_no_kv(llm, prompts):
    """The prefill worker's case: the first token is the whole answer, so the request
    ends there (nothing for a decode worker) and its blocks are freed at once."""
    engine = llm.engine
    params = _params(StructuredOutput("choice", json.dumps(["x"])))
    engine.add_request("one-token", prompts[2], params, prefill_only=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "stop"
    assert outputs[-1].kv_block_ids is None and not engine.holds_kv("one-token")
    assert engine.leak_report() == []


def test_bad_constraints_and_off_grammar_replays_are_refused(llm, prompts):
    engine = llm.engine
    for structured in (StructuredOutput("regex", "[a-"), StructuredOutput("json", "{not json"),
                       StructuredOutput("choice", "[1, 2]"),
                       StructuredOutput("grammar", "start: undefined_rule")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", prompts[0], _params(structured))
        assert info.value.param == "structured_output"
    # JSON's first tokens ('{"') cannot start the regex's text.
    json_ids = llm.generate(prompts[:1], _params(CONSTRAINTS["json"][0]),
                            use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompts[0], _params(CONSTRAINTS["regex"][0]),
                           output_token_ids=json_ids[:3])  # fmt: skip
    assert info.value.param == "output_token_ids"
    with pytest.raises(InvalidRequestError, match="nothing is left") as info:  # complete
        engine.add_request("bad", prompts[0], _params(CONSTRAINTS["json"][0]),
                           output_token_ids=json_ids)  # fmt: skip
    assert engine.leak_report() == []
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutput("yaml", "a: b")


def test_without_llguidance_or_a_tokenizer_only_structured_requests_fail(
    tiny_llama, tmp_path, monkeypatch, prompts
):
    """A worker warms llguidance up before serving; where it cannot (the GPU image lacks
    the package, a checkpoint lacks tokenizer.json) it serves free text and refuses
    constrained requests with the reason."""
    structured = CONSTRAINTS["regex"][0]
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama, bare)
    (bare / "tokenizer.json").unlink()
    engine = LLMEngine(bare)  # token ids in and out: no tokenizer needed otherwise
    assert not engine.grammars.warm_up()
    with pytest.raises(InvalidRequestError, match="tokenizer.json") as info:
        engine.add_request("c", prompts[0], _params(structured))
    assert info.value.param == "structured_output"
    assert engine.leak_report() == []
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as if not installed
    llm = LLM(tiny_llama)
    assert not llm.engine.grammars.warm_up()
    with pytest.raises(InvalidRequestError, match="llguidance package"):
        llm.engine.add_request("c", prompts[0], _params(structured))
    free = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(free[0].outputs[0].token_ids) == 4
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("prefill_only", [False, True])
def test_a_grammar_llguidance_gives_up_on_mid_generation_is_the_requests_fault(
    llm, prompts, prefill_only
):
    """``a{1000000}`` compiles and gives a first mask, then its lexer exceeds llguidance's
    limits at the first token. The request ends with an error naming the constraint
    (services answer it as invalid input: an audit found it failing as a worker fault,
    which made the router mark decode workers unhealthy); the refused token is not kept
    for a decode worker, and sampling does not crash on a mask with nothing allowed."""
    engine = llm.engine
    structured = StructuredOutput("regex", "a{1000000}")
    for i, temperature in enumerate((0.0, 1.0)):
        request_id = f"gives-up-{prefill_only}-{i}"
        params = _params(structured, temperature=temperature, seed=1)
        engine.add_request(request_id, prompts[1], params, prefill_only=prefill_only)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        final = outputs[-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        assert final.error_param == "structured_output" and "constraint failed" in final.error
        assert not engine.holds_kv(request_id)
    assert engine.leak_report() == []


def test_a_grammar_complete_at_max_tokens_is_a_stop_not_a_cut(llm, prompts):
    params = _params(StructuredOutput("regex", "[a-z]"), max_tokens=1)
    for output in llm.generate(prompts, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        assert re.fullmatch("[a-z]", output.outputs[0].text)


def test_a_failed_matcher_leaves_the_sampler_something_to_draw(llm):
    """Once llguidance has given up, its mask allows nothing; an all -inf row would make
    seeded sampling raise in the engine step (failing every request on the worker)."""
    grammars = llm.engine.grammars
    grammars.add("failed", grammars.prepare(CONSTRAINTS["regex"][0], ()))
    assert grammars.allowed("failed").sum() < grammars.vocab_size
    assert grammars.accept("failed", 0) is not None  # id 0 is <pad>: refused, matcher failed
    assert bool(grammars.allowed("failed").all())
    grammars.discard("failed")
    assert llm.engine.leak_report() == []


def test_a_constraint_after_the_thinking_leaves_the_thinking_free(model_factory):
    """A reasoning model's constraint (router/reasoning.py) starts after its thinking:
    the output thinks freely up to ``</think>`` (made likely here by a logit bias), then
    matches the constraint, greedy and sampled."""
    llm = LLM(model_factory("qwen3"))
    (end_id,) = llm.tokenizer.encode("</think>", add_special_tokens=False)
    prompts = random_prompts((6, 20, 40), seed=32)
    thoughts = []
    for kind in ("json", "regex"):
        base, valid = CONSTRAINTS[kind]
        structured = StructuredOutput(base.kind, base.spec, "<think>", "</think>")
        for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 9}):
            params = _params(structured, logit_bias={end_id: 6.0}, **sampling)
            for output in llm.generate(prompts, params, use_tqdm=False):
                completion = output.outputs[0]
                thought, tag, answer = completion.text.partition("</think>")
                assert tag and completion.finish_reason == "stop", completion
                assert valid(answer), completion.text
                thoughts.append(thought)
    assert any(t and not CONSTRAINTS["regex"][1](t) for t in thoughts)  # free text in there
    assert llm.engine.leak_report() == []
