"""The OpenAI gateway through the official ``openai`` client, against a real ``pdserve up``
stack (router + 2 prefill + 1 decode workers, tracing to a real OTLP receiver):
conformance, parity with the offline engine, errors, prefix-aware placement, traces, and a
prefill worker dying under load."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest

from common.config_loader import load_config
from common.structured_output import StructuredOutput
from common.tokenizer import Tokenizer
from engine import LLM, PoolingParams, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from router.state import bad_words_token_ids
from tests.engine.helpers import random_prompts
from tests.support.otlp_receiver import Receiver, otlp_receiver
from tests.support.polling import eventually
from tests.support.processes import write_config
from tests.support.stack import get_json, metric, serving, worker_stats

KEY = "sk-pdserve-test"
MODEL = "tiny"


@pytest.fixture(scope="module")
def traces() -> Iterator[Receiver]:
    """Where the stack's processes send their spans (a real OTLP/HTTP receiver)."""
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory, traces):
    tmp = tmp_path_factory.mktemp("gateway")
    config = write_config(
        tmp / "config.yaml",
        tiny_llama,
        num_prefill=2,
        tracing={"otlp_traces_endpoint": traces.url},
        router={
            "api_keys": [KEY],
            "served_model_name": MODEL,
            "min_disagg_tokens": 0,
            "max_inflight_sequences": 8,
            "refresh_interval_s": 0.5,
            "worker_stall_timeout_s": 2.0,
            "tool_call_parser": "hermes",
        },
    )
    with serving(config, tmp / "home", restart=False) as stack:  # kill tests: stay dead
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return stack.openai_client(KEY)


class _AsyncClient:
    """An AsyncOpenAI made on first use inside the running event loop (each test's
    ``asyncio.run`` has its own loop, and a client's connections belong to one)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    @property
    def completions(self):
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=KEY, max_retries=0).completions


@pytest.fixture(scope="module")
def aclient(stack) -> _AsyncClient:
    return _AsyncClient(f"{stack.base_url}/v1")


def test_models_health_and_auth(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    for path in ("/health", "/ping", "/version"):  # open without a key (probes)
        assert get_json(f"{stack.base_url}{path}")[0] == 200, path
    status, body = get_json(f"{stack.base_url}/v1/models", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()


def test_up_means_every_worker_is_placed_on_and_only_workers_load_torch(stack):
    """The router starts beside the workers, yet ``pdserve up`` reports the stack up only
    once the router places work on all three; and of the stack's processes only the workers
    map libtorch (the launcher and the router would pay ~2.5 s of CPU each to import it)."""
    assert metric(stack, "pdserve:worker_available") == 3
    children = stack.children()
    assert set(children) == {"router", "prefill-0", "prefill-1", "decode-0"}

    def maps_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    assert not maps_torch(stack.proc.pid) and not maps_torch(children["router"])
    assert all(maps_torch(children[name]) for name in ("prefill-0", "prefill-1", "decode-0"))


def test_greedy_completions_equal_offline(client, tiny_llama):
    prompts = random_prompts((5, 40, 100), seed=81)
    offline = LLM(tiny_llama).generate(
        prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0), use_tqdm=False
    )
    reply = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
        extra_body={"min_tokens": 12, "return_token_ids": True},
    )  # fmt: skip
    by_index = sorted(reply.choices, key=lambda c: c.index)
    for choice, expected in zip(by_index, offline, strict=True):
        assert choice.model_extra["token_ids"] == expected.outputs[0].token_ids
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert reply.usage.completion_tokens == 36
    # Streamed, the same tokens arrive in order.
    stream = client.completions.create(
        model=MODEL, prompt=prompts[2], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 12, "return_token_ids": True},
    )  # fmt: skip
    tokens, text, usage = [], "", None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            tokens += choice.model_extra["token_ids"]
            text += choice.text
    assert tokens == offline[2].outputs[0].token_ids and text == offline[2].outputs[0].text
    assert usage.completion_tokens == 12 and usage.prompt_tokens == 100


def test_return_token_ids_gives_the_prompts_ids_too(stack, client):
    """vLLM's return_token_ids: each completion choice carries its prompt's ids, a chat
    reply carries them once at the top; streamed, in a choice's (chat: the reply's) first
    chunk only. Without it, neither field."""
    prompts = random_prompts((12, 9), seed=93)
    ask = dict(model=MODEL, prompt=prompts, max_tokens=3, n=2, temperature=1.0, seed=4)
    reply = client.completions.create(**ask, extra_body={"return_token_ids": True})
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert [c.model_extra["prompt_token_ids"] for c in choices] == [prompts[0]] * 2 + [
        prompts[1]
    ] * 2
    firsts: dict[int, list[int]] = {}
    for chunk in client.completions.create(
        **ask, stream=True, extra_body={"return_token_ids": True}
    ):
        (choice,) = chunk.choices
        ids = choice.model_extra.get("prompt_token_ids")
        assert (ids is not None) == (choice.index not in firsts)
        firsts.setdefault(choice.index, ids)
    assert [firsts[i] for i in range(4)] == [prompts[0]] * 2 + [prompts[1]] * 2
    plain = client.completions.create(**ask).choices[0]
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.model_extra
    messages = [{"role": "user", "content": "hello there"}]
    headers = {"Authorization": f"Bearer {KEY}"}
    tokenized = httpx.post(f"{stack.base_url}/tokenize", headers=headers, timeout=30,
                           json={"messages": messages}).json()["tokens"]  # fmt: skip
    chat = dict(model=MODEL, messages=messages, max_tokens=3, extra_body={"return_token_ids": True})
    assert client.chat.completions.create(**chat).model_extra["prompt_token_ids"] == tokenized
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == tokenized
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, tiny_llama, stack):
    """vLLM's ``truncate_prompt_tokens``: a prompt past the context is cut to its last k
    tokens, the reply is that of those k tokens, and usage and echo show what was kept."""
    max_model_len = stack.config["engine"]["max_model_len"]
    (prompt,) = random_prompts((max_model_len + 50,), seed=83)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    (offline,) = LLM(tiny_llama).generate([prompt[-40:]], params, use_tqdm=False)
    ask = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    extra = {"min_tokens": 6, "return_token_ids": True, "truncate_prompt_tokens": 40}
    reply = client.completions.create(**ask, extra_body=extra)
    assert reply.choices[0].model_extra["token_ids"] == offline.outputs[0].token_ids
    assert reply.usage.prompt_tokens == 40
    echoed = client.completions.create(**ask, echo=True, extra_body=extra).choices[0].text
    kept = Tokenizer(tiny_llama).decode(prompt[-40:], skip_special_tokens=False)
    assert echoed == kept + offline.outputs[0].text
    # truncation_side "right" keeps the first 40 tokens instead.
    right = client.completions.create(**ask, echo=True, extra_body={
        **extra, "truncation_side": "right"}).choices[0]  # fmt: skip
    assert right.model_extra["prompt_token_ids"] == prompt[:40]
    assert right.text.startswith(
        Tokenizer(tiny_llama).decode(prompt[:40], skip_special_tokens=False)
    )
    with pytest.raises(openai.BadRequestError) as info:  # not cut, it does not fit
        client.completions.create(**ask)
    assert info.value.body["param"] == "prompt"
    chat = [{"role": "user", "content": "word " * 3000}]
    reply = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=2, extra_body={"truncate_prompt_tokens": 64}
    )
    assert reply.usage.prompt_tokens == 64


def test_echo_scores_the_prompt_as_lm_eval_asks(client, tiny_llama):
    """lm-eval's loglikelihood request (token ids, echo, logprobs=1, max_tokens=1): the
    prompt's log-probs come back first, computed by the prefill worker, equal to the
    offline engine's, streamed or not, even for a prompt the workers have cached."""
    prompt = random_prompts((37,), seed=7)[0]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    (offline,) = LLM(tiny_llama).generate([prompt], params, use_tqdm=False)
    expected = [lp.logprob for lp in offline.prompt_logprobs[1:]]
    expected.append(offline.outputs[0].logprobs[0].logprob)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # cache it
    ask = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    reply = client.completions.create(**ask)
    (choice,) = reply.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert choice.text == "".join(logprobs.tokens)
    streamed_tokens, streamed_logprobs, text = [], [], ""
    for chunk in client.completions.create(**ask, stream=True):
        for part in chunk.choices:
            text += part.text
            streamed_tokens += part.logprobs.tokens
            streamed_logprobs += part.logprobs.token_logprobs
    assert (streamed_tokens, text) == (logprobs.tokens, choice.text)
    assert streamed_logprobs[0] is None
    assert streamed_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-6)
    # Without logprobs, echo repeats the prompt's text as sent.
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith("Hello there")
    # max_tokens 0 with echo (OpenAI's, older lm-eval's): the prompt alone, scored.
    only = client.completions.create(**{**ask, "max_tokens": 0})
    (echoed,) = only.choices
    assert (echoed.finish_reason, only.usage.completion_tokens) == ("length", 0)
    assert echoed.logprobs.tokens == logprobs.tokens[:-1] == streamed_tokens[:-1]
    assert echoed.logprobs.token_logprobs[1:] == pytest.approx(expected[:-1], abs=1e-4)
    assert echoed.text == "".join(echoed.logprobs.tokens)
    chunks = list(client.completions.create(**{**ask, "max_tokens": 0}, stream=True))
    assert "".join(part.text for c in chunks for part in c.choices) == echoed.text
    assert [part.finish_reason for c in chunks for part in c.choices][-1] == "length"
    with pytest.raises(openai.BadRequestError) as info:  # without echo it is no request
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_logprobs_name_their_tokens_by_id_when_asked(client):
    """vLLM's return_tokens_as_token_ids: every token a log-prob names (echoed prompt,
    generated, top entries) is "token_id:<id>", text offsets count those names; the
    numbers and the text are as without it. Chat's tokens and bytes too."""
    prompt = random_prompts((20,), seed=92)[0]
    ask = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    plain = client.completions.create(**ask, extra_body={"return_token_ids": True}).choices[0]
    named = client.completions.create(**ask, extra_body={"return_tokens_as_token_ids": True})
    named = named.choices[0]
    ids = prompt + plain.model_extra["token_ids"]
    assert named.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert named.text == plain.text
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    offsets, tokens = named.logprobs.text_offset, named.logprobs.tokens
    assert [b - a for a, b in itertools.pairwise(offsets)] == [len(t) for t in tokens[:-1]]
    tops = zip(named.logprobs.top_logprobs[1:], plain.logprobs.top_logprobs[1:], strict=True)
    for ours, theirs in tops:
        assert all(key.startswith("token_id:") for key in ours)
        assert sorted(ours.values()) == sorted(theirs.values())
    streamed = client.completions.create(
        **ask, stream=True, extra_body={"return_tokens_as_token_ids": True}
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for part in parts for t in part.tokens] == tokens
    assert [o for part in parts for o in part.text_offset] == offsets
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    content = chat.logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)


def test_vllms_prompt_logprobs_match_the_offline_engine(client, tiny_llama):
    """vLLM's prompt_logprobs field: each prompt token with its top n, equal to the offline
    engine's; scored once with echo's logprobs, each shown with its own top n."""
    prompt = random_prompts((29,), seed=8)[0]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    (offline,) = LLM(tiny_llama).generate([prompt], params, use_tqdm=False)
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    (choice,) = reply.choices
    got = choice.model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for position, (entries, expected) in enumerate(zip(got[1:], offline.prompt_logprobs[1:],
                                                       strict=True), start=1):  # fmt: skip
        wanted = {expected.token_id: (expected.logprob, expected.rank)}
        tops = zip(expected.top_token_ids, expected.top_logprobs, strict=True)
        for rank, (token_id, logprob) in enumerate(tops, start=1):
            wanted.setdefault(token_id, (logprob, rank))
        assert {int(t): e["rank"] for t, e in entries.items()} == {
            t: rank for t, (_, rank) in wanted.items()
        }, position
        for token_id, entry in entries.items():
            assert entry["logprob"] == pytest.approx(wanted[int(token_id)][0], abs=1e-4)
        assert entries[str(prompt[position])]["rank"] == expected.rank
    # Echo's own logprobs=1: one top entry besides the prompt token, not three.
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Score me."}], max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == chat.usage.prompt_tokens and scored[0] is None
    assert all(len(entries) == 1 for entries in scored[1:])


def test_penalties_cross_the_disaggregated_path_unchanged(client, tiny_llama):
    """The prefill worker samples the first token and the decode worker the rest, both
    with the prompt and the outputs so far: tokens equal the offline engine's."""
    prompts = random_prompts((30, 70), seed=87)
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4}
    offline = LLM(tiny_llama).generate(
        prompts, SamplingParams(max_tokens=16, min_tokens=16, temperature=0, **penalties),
        use_tqdm=False,
    )  # fmt: skip
    reply = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=16, temperature=0,
        presence_penalty=0.5, frequency_penalty=0.4,
        extra_body={"min_tokens": 16, "return_token_ids": True, "repetition_penalty": 1.3},
    )  # fmt: skip
    by_index = sorted(reply.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in by_index] == [
        o.outputs[0].token_ids for o in offline
    ]


def test_logit_bias_and_allowed_token_ids_cross_the_disaggregated_path(client, tiny_llama):
    """Both workers sample with them (the prefill worker the first token): greedy tokens
    equal the offline engine's with the same bias, +100 forces a token, and sampling
    draws only allowed ids."""
    prompts = random_prompts((30, 70), seed=88)
    llm = LLM(tiny_llama)
    greedy = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    # Push down each prompt's greedy first token, and one of the first prompt's later ones.
    bias = {t: -5.0 for o in plain for t in o.outputs[0].token_ids[:1]}
    bias[plain[0].outputs[0].token_ids[4]] = -3.0
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, logit_bias=bias)
    offline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert offline != [o.outputs[0].token_ids for o in plain]  # the bias moves them

    def completion(**extra):
        reply = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=8, temperature=extra.pop("temperature", 0),
            extra_body={"min_tokens": 8, "return_token_ids": True, **extra},
        )  # fmt: skip
        return [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]

    assert completion(logit_bias={str(t): b for t, b in bias.items()}) == offline
    assert completion(logit_bias={"77": 100}) == [[77] * 8] * len(prompts)
    allowed = [5, 77, 300, 901]
    drawn = completion(allowed_token_ids=allowed, temperature=1.0, seed=3)
    assert {t for ids in drawn for t in ids} <= set(allowed)
    assert len({t for ids in drawn for t in ids}) > 1


def test_bad_words_cross_the_disaggregated_path(client, tiny_llama):
    """The router tokenizes bad words as vLLM does; both workers ban them: greedy tokens
    equal the offline engine's with those token sequences, which never appear."""
    prompts = random_prompts((30, 70), seed=89)
    llm = LLM(tiny_llama)
    greedy = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    tokenizer = Tokenizer(tiny_llama)
    words = [tokenizer.decode([ids[2]]).strip() or "x" for ids in plain[:2]]
    sequences = bad_words_token_ids(tokenizer, words)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0,
                            bad_words_token_ids=sequences)  # fmt: skip
    offline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert offline != plain  # the words were there
    reply = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
        extra_body={"min_tokens": 8, "return_token_ids": True, "bad_words": words},
    )  # fmt: skip
    served = [c.model_extra["token_ids"] for c in sorted(reply.choices, key=lambda c: c.index)]
    assert served == offline
    for ids in served:
        for word in sequences:
            assert all(ids[i : i + len(word)] != word for i in range(len(ids)))


def test_structured_outputs_cross_the_disaggregated_path(client, tiny_llama):
    """Both workers constrain: the prefill worker's first token and the decode worker's
    rest equal the offline engine's, greedy and seeded, and each text matches. A one-token
    choice ends on the prefill worker; a bad schema is a 400 naming its field."""
    schema = {"type": "object", "properties": {"id": {"type": "integer", "maximum": 999},
              "ok": {"type": "boolean"}}, "required": ["id", "ok"],
              "additionalProperties": False}  # fmt: skip
    regex = r"[a-z]{3,6}-[0-9]{2}"
    prompts = random_prompts((30, 70), seed=91)
    llm = LLM(tiny_llama)
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r",
                                                                     "schema": schema}}},
         StructuredOutput("json", json.dumps(schema)), 0.0),
        ({"structured_outputs": {"regex": regex}}, StructuredOutput("regex", regex), 1.0),
    ]  # fmt: skip
    for extra, structured, temperature in cases:
        params = SamplingParams(max_tokens=48, temperature=temperature, seed=4,
                                structured_output=structured)  # fmt: skip
        offline = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        reply = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=48, temperature=temperature, seed=4,
            extra_body={"return_token_ids": True, **extra},
        )  # fmt: skip
        choices = sorted(reply.choices, key=lambda c: c.index)
        assert [c.model_extra["token_ids"] for c in choices] == [o.token_ids for o in offline]
        for choice in choices:
            assert choice.finish_reason == "stop"
            if structured.kind == "json":
                assert set(json.loads(choice.text)) == {"id", "ok"}
            else:
                assert re.fullmatch(regex, choice.text), choice.text
    # Chat, streamed: the same text as not streamed, and it is the JSON asked for.
    messages = [{"role": "user", "content": "Give me a record."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    ask = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 48,
           "response_format": response_format}  # fmt: skip
    whole = client.chat.completions.create(**ask)
    stream = client.chat.completions.create(**ask, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert set(json.loads(text)) == {"id", "ok"}
    one = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8,
                                    extra_body={"guided_choice": ["x"]})  # fmt: skip
    assert (one.choices[0].text, one.choices[0].finish_reason) == ("x", "stop")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "nonsense"}})  # fmt: skip
    assert info.value.body["param"] == "guided_json"
    # A constraint llguidance gives up on at the first token (its lexer over the limits)
    # is the request's fault: a 400 from the worker, which stays healthy, streamed or not.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            body = {"guided_regex": "a{1000000}"}
            reply = client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                              stream=stream, extra_body=body)  # fmt: skip
            list(reply) if stream else None
        assert info.value.body["param"] == "guided_regex"  # the field it came in
    again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8,
                                      extra_body={"guided_choice": ["x"]})  # fmt: skip
    assert again.choices[0].text == "x"
    # vLLM's structural tag: once the model writes the trigger (pushed to here by a logit
    # bias on that special token), the tagged segment is the schema's JSON, then its end.
    start = Tokenizer(tiny_llama).token_id("<|im_start|>")
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    tag = {"structures": [{"begin": "<|im_start|>call", "schema": schema, "end": "</call>"}],
           "triggers": ["<|im_start|>"]}  # fmt: skip
    tagged = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0,
        extra_body={"structural_tag": tag, "logit_bias": {str(start): 100},
                    "skip_special_tokens": False},
    ).choices[0].message.content  # fmt: skip
    assert re.match(r'<\|im_start\|>call\{\s*"a"\s*:\s*"[xy]"\s*\}</call>', tagged), tagged


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}  # fmt: skip


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    """Tool calls put together from stream deltas, by index, and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                into = calls.setdefault(delta.index, {"name": None, "arguments": "", "id": None})
                into["id"] = delta.id or into["id"]
                if delta.function.name:
                    into["name"] = delta.function.name
                into["arguments"] += delta.function.arguments or ""
    return calls, finish


def test_a_reply_continues_the_final_message(stack, client, tiny_llama):
    """vLLM's continue_final_message: the prompt is the chat cut after the last message's
    text (what /tokenize says), and the reply is what a completion of it generates."""
    messages = [{"role": "user", "content": "Count with me."},
                {"role": "assistant", "content": "One, two,"}]  # fmt: skip
    extra = {"continue_final_message": True, "add_generation_prompt": False, "min_tokens": 6}
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0, extra_body=extra)  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    tokenized = httpx.post(f"{stack.base_url}/tokenize", headers=headers, timeout=30, json={
        "messages": messages, "continue_final_message": True,
        "add_generation_prompt": False}).json()  # fmt: skip
    prompt_text = Tokenizer(tiny_llama).decode(tokenized["tokens"], skip_special_tokens=False)
    assert prompt_text.endswith("One, two,")
    completion = client.completions.create(model=MODEL, prompt=tokenized["tokens"], max_tokens=6,
                                           temperature=0, extra_body={"min_tokens": 6})  # fmt: skip
    assert reply.choices[0].message.content == completion.choices[0].text
    assert reply.usage.prompt_tokens == tokenized["count"]
    fresh = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert fresh.usage.prompt_tokens > tokenized["count"]  # a new turn's markup, not cut
    # vLLM's echo: the continued message, then the reply; streamed or not, n > 1 too. The
    # usage counts the reply only.
    echo = {**extra, "echo": True}
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0, n=2, extra_body=echo)  # fmt: skip
    expected = "One, two," + completion.choices[0].text
    assert [c.message.content for c in echoed.choices] == [expected] * 2
    assert echoed.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True, extra_body=echo
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.content.startswith("One, two,")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    # A user message last: nothing to echo.
    asked = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4,
                                           temperature=0, extra_body={"echo": True})  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4,
                                           temperature=0)  # fmt: skip
    assert asked.choices[0].message.content == plain.choices[0].message.content


def test_tool_calls_by_constraint(client):
    """A named function or "required": the output is the call(s), valid against the
    tools' schemas, as OpenAI's tool_calls; streamed deltas add up to the same calls."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = {"model": MODEL, "messages": messages, "tools": [WEATHER, CLOCK], "temperature": 0,
           "max_tokens": 128}  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**ask, tool_choice=named)
    message = whole.choices[0].message
    assert message.content is None and whole.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    streamed, finish = _streamed_calls(client.chat.completions.create(**ask, tool_choice=named,
                                                                      stream=True))  # fmt: skip
    assert finish == "stop" and [(c["name"], c["arguments"]) for c in streamed.values()] == [
        ("get_weather", call.function.arguments)]  # fmt: skip
    for parallel in (False, True):
        whole = client.chat.completions.create(**ask, tool_choice="required",
                                               parallel_tool_calls=parallel)  # fmt: skip
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            json.loads(call.function.arguments)
        streamed, finish = _streamed_calls(client.chat.completions.create(
            **ask, tool_choice="required", parallel_tool_calls=parallel, stream=True))  # fmt: skip
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in calls]  # fmt: skip
    # A function not in tools and a second constraint are refused by name.
    for extra, param in (({"tool_choice": {"type": "function", "function": {"name": "x"}}},
                          "tool_choice"),
                         ({"tool_choice": "required", "response_format": {"type": "json_object"}},
                          "response_format")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, **extra)
        assert info.value.body["param"] == param, extra
    # A tool's schema llguidance gives up on at the first token: a 400 naming tools.
    huge = {"type": "function", "function": {"name": "h", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a{1000000}$"}},
        "required": ["s"]}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**ask, "tools": [huge]}, tool_choice="required")
    assert info.value.body["param"] == "tools"
    # History with calls: this model's template never mentions them, so it would drop
    # them; refused rather than answered as if they were not there.
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="does not render tool calls") as info:
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert info.value.body["param"] == "messages"


def test_tool_choice_auto_reads_hermes_calls_from_the_text(client):
    """This stack's router reads Hermes-format calls (router.tool_call_parser). The random
    model never writes one, so a regex makes it: the call is read from the text, whole
    and streamed; text without one stays content."""
    call = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    forced = {"structured_outputs": {"regex": re.escape(f"Sure.<tool_call>{call}</tool_call>")}}
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "time?"}],
           "tools": [WEATHER, CLOCK], "temperature": 0, "max_tokens": 64}  # fmt: skip
    whole = client.chat.completions.create(**ask, extra_body=forced)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    ((name, arguments),) = [(c.function.name, c.function.arguments)
                            for c in choice.message.tool_calls]  # fmt: skip
    assert (name, json.loads(arguments)) == ("get_time", {"zone": "CET"})
    streamed, finish = _streamed_calls(client.chat.completions.create(**ask, extra_body=forced,
                                                                      stream=True))  # fmt: skip
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(name, arguments)]
    plain = client.chat.completions.create(**ask, tool_choice="auto").choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    assert plain.finish_reason in ("stop", "length")


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Say something about gRPC."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0)  # fmt: skip
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, roles, usage, reasons = "", [], None, []
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            roles.append(choice.delta.role)
            reasons.append(choice.finish_reason)
    assert text == whole.choices[0].message.content
    assert roles[0] == "assistant" and reasons[-1] == whole.choices[0].finish_reason
    assert usage.total_tokens == whole.usage.total_tokens


def test_responses_api_equals_chat_whole_and_streamed(client):
    """``/v1/responses`` (router/responses.py) runs the chat path: a chat completion's
    text, whole and streamed event by event; its usage; a schema's output through the
    SDK's stream helper."""
    question = "Say something about gRPC."
    ask = {"model": MODEL, "instructions": "Answer briefly.", "input": question,
           "max_output_tokens": 10, "temperature": 0}  # fmt: skip
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": question}]  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          temperature=0)  # fmt: skip
    expected = chat.choices[0].message.content
    status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    whole = client.responses.create(**ask)
    assert (whole.output_text, whole.status) == (expected, status)
    assert whole.id.startswith("resp_") and whole.store is False and whole.model == MODEL
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)  # fmt: skip
    events = list(client.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected == events[-1].response.output_text
    # Log-probs when include asks (with top_logprobs alternatives): chat's, whole and
    # streamed (the deltas' add up to the finished text's), also where a stream holds text
    # back (a character split over byte tokens: sampled, 30 tokens of random weights).
    sampled = {"temperature": 1.0, "max_tokens": 30, "extra_body": {"seed": 3}}
    chat = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True,
                                          top_logprobs=2, **sampled)  # fmt: skip
    expected_logprobs = [(t.token, t.logprob, len(t.top_logprobs))
                         for t in chat.choices[0].logprobs.content]  # fmt: skip
    assert len(expected_logprobs) == 30
    with_logprobs = {**ask, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
                     "temperature": 1.0, "max_output_tokens": 30,
                     "extra_body": {"seed": 3}}  # fmt: skip
    (part,) = client.responses.create(**with_logprobs).output[0].content
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in part.logprobs] == expected_logprobs
    events = list(client.responses.create(**with_logprobs, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in done.logprobs]
    assert [(t.token, t.logprob, len(t.top_logprobs)) for t in done.logprobs] == expected_logprobs
    schema = {"type": "json_schema", "name": "n", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}  # fmt: skip
    with client.responses.stream(**{**ask, "max_output_tokens": 32},
                                 text={"format": schema}) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.status == "completed" and set(json.loads(final.output_text)) == {"n"}


def test_responses_api_function_calls(client):
    """Flat function tools and a named tool_choice: a function_call item whose arguments
    are the chat path's, whole and streamed; a call's output given back in ``input`` is
    refused here only because this model's template cannot render it."""
    tools = [{"type": "function", **tool["function"]} for tool in (WEATHER, CLOCK)]
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": tools,
           "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0,
           "max_output_tokens": 64}  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ask["input"]}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        max_tokens=64,
    )  # fmt: skip
    (expected,) = chat.choices[0].message.tool_calls
    whole = client.responses.create(**ask)
    (item,) = whole.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.arguments == expected.function.arguments and item.call_id
    events = list(client.responses.create(**ask, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == expected.function.arguments
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert (done.type, done.name, done.arguments) == ("function_call", "get_weather",
                                                      expected.function.arguments)  # fmt: skip
    call = {"type": "function_call", "call_id": item.call_id, "name": item.name,
            "arguments": item.arguments}  # fmt: skip
    output = {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
    history = [{"role": "user", "content": ask["input"]}, call, output]
    with pytest.raises(openai.BadRequestError, match="does not render tool calls") as info:
        client.responses.create(model=MODEL, input=history, tools=tools)
    assert info.value.body["param"] == "input"


def test_responses_truncation_auto_drops_the_oldest_turns(client, stack):
    """A conversation past the context: refused as it is (``truncation`` disabled, the
    default), served without its oldest turns with ``truncation: "auto"``."""
    max_model_len = stack.config["engine"]["max_model_len"]
    turn = "word " * (max_model_len // 12)  # about 170 tokens: 7 turns do not fit, 5 do
    conversation = [{"role": role, "content": f"{index}: {turn}"}
                    for index, role in enumerate(["user", "assistant"] * 3 + ["user"])]  # fmt: skip
    ask = {"model": MODEL, "input": conversation, "instructions": "Be brief.",
           "max_output_tokens": 4}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**ask)
    assert (info.value.body["param"], info.value.body["code"]) == (
        "input",
        "context_length_exceeded",
    )
    reply = client.responses.create(**ask, truncation="auto")
    assert reply.truncation == "auto" and reply.output  # (cut at max_output_tokens)
    assert reply.usage.input_tokens + 4 <= max_model_len
    # Only the oldest turns went: the last one alone is what a fresh conversation sends.
    last_only = client.responses.create(**{**ask, "input": conversation[-1:]})
    assert reply.usage.input_tokens > last_only.usage.input_tokens


def test_responses_api_refusals_name_their_field(client):
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]
    for extra, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": image}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 5}, "temperature"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**{"model": MODEL, "input": "hi", **extra})
        assert info.value.body["param"] == param, extra
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-17", input="hi")


def test_embeddings_equal_offline_on_either_role(stack, client, tiny_llama):
    """``/v1/embeddings`` through the stack: every input's vector is the offline engine's
    (floats or base64, text or token ids, unit length or raw), computed on the prefill
    workers (min_disagg_tokens 0: every prompt goes there). A decode worker answers
    ``Embed`` too, with the same vector; an unknown adapter is its NOT_FOUND (unloaded
    since the router placed it, most often: the router's 404)."""
    texts = ["The capital of France is", "a longer text, " * 30]
    llm = LLM(tiny_llama)
    expected = [o.embedding.tolist() for o in llm.embed(texts, use_tqdm=False)]
    unnormalized = llm.embed(texts, PoolingParams(normalize=False), use_tqdm=False)
    raw = [o.embedding.tolist() for o in unnormalized]
    tokens = [Tokenizer(tiny_llama).encode(text) for text in texts]

    def queried(role: str) -> int:
        return sum(s.prefix_query_tokens for s in worker_stats(stack, role))

    before = {role: queried(role) for role in ("prefill", "decode")}
    replies = [
        (client.embeddings.create(model=MODEL, input=texts, encoding_format="float"), expected),
        (client.embeddings.create(model=MODEL, input=texts), expected),  # base64, decoded
        (client.embeddings.create(model=MODEL, input=tokens), expected),
        (client.embeddings.create(model=MODEL, input=texts, extra_body={"normalize": False}),
         raw),
    ]  # fmt: skip
    for reply, vectors in replies:
        assert reply.model == MODEL and [item.index for item in reply.data] == [0, 1]
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, tokens))
        for item, vector in zip(reply.data, vectors, strict=True):
            assert item.embedding == pytest.approx(vector, abs=1e-5)
    assert eventually(lambda: queried("prefill") - before["prefill"] == 4 * sum(map(len, tokens)))
    assert queried("decode") == before["decode"]
    # More inputs than the stack runs sequences at once (8): they run 8 at a time.
    many = client.embeddings.create(model=MODEL, input=texts * 10, encoding_format="float")
    assert [item.index for item in many.data] == list(range(20))
    for item, vector in zip(many.data, expected * 10, strict=True):
        assert item.embedding == pytest.approx(vector, abs=1e-5)
    config = load_config(str(stack.config_path))
    address = f"{config.decode.host}:{config.decode.ports(0).grpc}"
    with grpc.insecure_channel(address) as channel:
        embed = pb_grpc.DecodeServiceStub(channel).Embed
        reply = embed(pb.EmbedRequest(request_id="direct", token_ids=tokens[1], normalize=True),
                      timeout=30)  # fmt: skip
        vector = np.frombuffer(reply.embedding, dtype="<f4").tolist()
        assert vector == pytest.approx(expected[1], abs=1e-5)
        assert reply.timings.prefill_ms > 0  # the worker's stage timings, as a prefill's
        with pytest.raises(grpc.RpcError) as refused:
            embed(pb.EmbedRequest(request_id="x", token_ids=[5], lora_name="nope"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=MODEL, input=[[5] * 10_000])
    assert too_long.value.body["param"] == "input"


def test_score_and_rerank_are_cosines_of_the_offline_embeddings(stack, tiny_llama):
    """The default score method: ``/v1/score`` (1 to N, and N to N) and ``/v1/rerank``
    give the dot products of the offline engine's unit embeddings; rerank sorts them,
    best first, and keeps ``top_n``. A decode worker's ``Embed`` with logit token ids
    returns the offline engine's logits there."""
    query, documents = "where is paris", ["paris is in france", "a cat sat", "where is it"]
    llm = LLM(tiny_llama)
    texts = [query, *documents]
    embedded = llm.embed(texts, use_tqdm=False)
    vectors = {text: o.embedding for text, o in zip(texts, embedded, strict=True)}
    cosines = [float(vectors[query] @ vectors[d]) for d in documents]
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    num_tokens = sum(len(Tokenizer(tiny_llama).encode(t)) for t in texts)

    def post(path: str, body: dict) -> dict:
        reply = httpx.post(f"{stack.base_url}{path}", json={"model": MODEL, **body},
                           headers=headers, timeout=60)  # fmt: skip
        assert reply.status_code == 200, reply.text
        return reply.json()

    scored = post("/v1/score", {"text_1": query, "text_2": documents})
    assert scored["object"] == "list" and scored["model"] == MODEL
    assert [item["index"] for item in scored["data"]] == [0, 1, 2]
    assert [item["score"] for item in scored["data"]] == pytest.approx(cosines, abs=1e-5)
    assert scored["usage"]["prompt_tokens"] == num_tokens  # each distinct text once
    reverse = documents[::-1]
    pairwise = post("/score", {"text_1": documents, "text_2": reverse})
    expected = [float(vectors[a] @ vectors[b]) for a, b in zip(documents, reverse, strict=True)]
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(expected, abs=1e-5)
    for first, second in [("queries", "documents"), ("queries", "items"), ("data_1", "data_2")]:
        named = post("/v1/score", {first: query, second: documents})  # newer vLLM's names
        assert [item["score"] for item in named["data"]] == pytest.approx(cosines, abs=1e-5)
    order = sorted(range(3), key=lambda i: -cosines[i])
    reranked = post("/v1/rerank", {"query": query, "documents": documents, "top_n": 2})
    assert [r["index"] for r in reranked["results"]] == order[:2]
    assert [r["document"]["text"] for r in reranked["results"]] == [documents[i] for i in order[:2]]
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx(
        [cosines[i] for i in order[:2]], abs=1e-5)  # fmt: skip
    assert reranked["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    bare = post("/rerank", {"query": query, "documents": documents, "return_documents": False})
    assert [r["index"] for r in bare["results"]] == order
    assert all("document" not in r for r in bare["results"])
    # The worker's side of a reranker's scores: logits at the ids asked for, in order.
    tokens = Tokenizer(tiny_llama).encode(query)
    ids = (557, 800, 2)
    expected_logits = llm.embed([tokens], PoolingParams(token_ids=ids), use_tqdm=False)
    config = load_config(str(stack.config_path))
    address = f"{config.decode.host}:{config.decode.ports(0).grpc}"
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.DecodeServiceStub(channel).Embed(
            pb.EmbedRequest(request_id="logits", token_ids=tokens, logit_token_ids=ids),
            timeout=30,
        )
    logits = np.frombuffer(reply.embedding, dtype="<f4").tolist()
    assert logits == pytest.approx(expected_logits[0].embedding.tolist(), abs=1e-4)


SERVER, CLIENT = 2, 3  # OTLP's span kinds


def test_a_request_is_one_trace_across_the_router_and_both_workers(stack, client, traces):
    """A client's ``traceparent`` makes the router's span its child; the prefill and the
    decode worker's spans are the router span's children, with the tokens the client was
    told and the stage times the engines measured. Without one, a request starts its own
    trace."""
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    prompt = random_prompts((70,), seed=95)[0]
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
    )  # fmt: skip

    def of(spans, service):
        return [s for s in spans if s.trace_id == trace_id and s.service == service]

    spans = traces.wait_for(lambda spans: all(
        of(spans, f"pdserve-{name}") for name in ("router", "prefill", "decode")))  # fmt: skip
    (router,) = of(spans, "pdserve-router")
    (prefill,) = of(spans, "pdserve-prefill")
    (decode,) = of(spans, "pdserve-decode")
    assert (router.name, router.kind, router.parent_span_id) == (
        "POST /v1/completions",
        SERVER,
        client_span,
    )
    assert router.attributes["gen_ai.request.model"] == MODEL
    assert router.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert router.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert router.attributes["pdserve.finish_reasons"] == reply.choices[0].finish_reason
    request_id = router.attributes["pdserve.request_id"]
    assert request_id == reply.id
    for span, name in ((prefill, "prefill"), (decode, "decode")):
        assert (span.name, span.kind, span.parent_span_id) == (name, SERVER, router.span_id)
        assert span.attributes["pdserve.request_id"] == f"{request_id}-0"
        assert span.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
        # Within the router's span; a handler returns just after its last reply left.
        assert router.start_ns <= span.start_ns <= span.end_ns < router.end_ns + 10**9
        assert not span.failed
    assert prefill.attributes["gen_ai.usage.output_tokens"] == 1  # the first token
    # Which replica served each call: the registry's names (2 prefill workers here).
    prefill_ids = [f"prefill@127.0.0.1:{stack.config['prefill']['port'] + 10 * i}"
                   for i in range(2)]  # fmt: skip
    assert prefill.instance in prefill_ids
    assert decode.instance == f"decode@127.0.0.1:{stack.config['decode']['port']}"
    assert router.instance == f"router@{socket.gethostname()}:{stack.config['router']['port']}"
    assert decode.attributes["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert decode.attributes["pdserve.blocks_pulled"] >= 1  # the prompt's KV, moved
    assert decode.attributes["pdserve.transfer_ms"] > 0
    assert prefill.start_ns < decode.start_ns
    # No trace context sent: the router's span is a root, its workers' its children.
    embedded = client.embeddings.create(model=MODEL, input=["one text", "and another"])

    def of_embedded(spans) -> list:  # the router's span and its 2 workers' (3 exports)
        return [s for s in spans
                if s.attributes.get("pdserve.request_id", "").startswith(embedded.id)]  # fmt: skip

    spans = of_embedded(traces.wait_for(lambda spans: len(of_embedded(spans)) == 3))
    (root,) = [s for s in spans if s.attributes.get("pdserve.request_id") == embedded.id]
    assert root.name == "POST /v1/embeddings" and root.parent_span_id == ""
    assert root.attributes["gen_ai.usage.input_tokens"] == embedded.usage.prompt_tokens
    children = [s for s in spans if s.parent_span_id == root.span_id]
    assert sorted(s.attributes["pdserve.request_id"] for s in children) == [
        f"{embedded.id}-0", f"{embedded.id}-1"]  # fmt: skip
    assert all(s.trace_id == root.trace_id and not s.failed for s in children)


def test_a_worker_span_notes_invalid_input_rather_than_failing(stack, traces):
    """A worker's span of a call whose input is invalid (the caller's error, a 400 at
    the router) is noted, not failed; the call's error code is unchanged by tracing."""
    config = load_config(str(stack.config_path))
    address = f"{config.decode.host}:{config.decode.ports(0).grpc}"
    trace_id = os.urandom(16).hex()
    metadata = (("traceparent", f"00-{trace_id}-{os.urandom(8).hex()}-01"),)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(pb.EmbedRequest(request_id="bad-embed", token_ids=[10**6]),
                       timeout=30, metadata=metadata)  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = traces.wait_for(lambda spans: any(s.trace_id == trace_id for s in spans))
    (span,) = [s for s in spans if s.trace_id == trace_id]
    assert (span.service, span.name, span.failed) == ("pdserve-decode", "embed", False)
    assert "prompt token ids must be" in span.attributes["pdserve.invalid_request"]


def test_a_stream_the_client_leaves_ends_its_spans_as_cancelled(client, traces):
    """The router's span and the decode worker's end when the client leaves, marked
    cancelled, not failed; nothing is left open."""
    trace_id = os.urandom(16).hex()
    prompt = random_prompts((40,), seed=96)[0]
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=400, temperature=0, stream=True,
        extra_body={"min_tokens": 400, "ignore_eos": True},
        extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
    )  # fmt: skip
    chunks = iter(stream)
    for _ in range(3):  # past the prefill worker's first token: the decode call is open
        next(chunks)
    stream.close()

    def ended(spans) -> bool:
        services = {s.service for s in spans if s.trace_id == trace_id}
        return {"pdserve-router", "pdserve-decode"} <= services

    spans = [s for s in traces.wait_for(ended) if s.trace_id == trace_id]
    router = next(s for s in spans if s.service == "pdserve-router")
    decode = next(s for s in spans if s.service == "pdserve-decode")
    assert router.attributes["gen_ai.usage.output_tokens"] < 400
    assert router.attributes.get("pdserve.cancelled") is True and not router.failed
    assert decode.attributes.get("pdserve.cancelled") is True and not decode.failed


def test_a_clients_request_id_names_the_response(client, aclient):
    """vLLM's: the response is "chatcmpl-<id>" (or "cmpl-") for the client's X-Request-Id,
    else its body's request_id; the same id twice at once serves both (the workers' ids
    stay unique)."""
    body = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                     extra_body={"request_id": "mine-1"})  # fmt: skip
    assert body.id == "cmpl-mine-1"
    chat = [{"role": "user", "content": "x"}]
    header = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat, max_tokens=2, extra_headers={"X-Request-Id": "trace-2"},
        extra_body={"request_id": "body-2"})  # fmt: skip
    assert header.parse().id == "chatcmpl-trace-2" and header.headers["x-request-id"] == "trace-2"

    async def twice() -> list[str]:
        replies = await asyncio.gather(*(
            aclient.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                       extra_body={"request_id": "again", "min_tokens": 8})
            for _ in range(2)))  # fmt: skip
        return [r.id for r in replies]

    assert asyncio.run(twice()) == ["cmpl-again", "cmpl-again"]
    # Any string is taken, as vLLM takes it; one not plain does not name the response.
    odd = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                    extra_body={"request_id": "a b/=="})  # fmt: skip
    assert odd.id.startswith("cmpl-") and "a b" not in odd.id


def test_stop_strings(client):
    prompt = random_prompts((20,), seed=82)[0]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"min_tokens": 24}).choices[0].text  # fmt: skip
    words = re.findall(r"[A-Za-z]{3,}", full)
    assert words, full
    stop = words[len(words) // 2]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                          temperature=0, stop=[stop, "\x00never"],
                                          stream=stream)  # fmt: skip
        chunks = list(reply) if stream else [reply]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert text == expected and reason == "stop"
        if not stream:  # ended by the router, yet the usage still counts the cached prefix
            assert reply.usage.prompt_tokens_details.cached_tokens > 0, reply.usage
        # vLLM's include_stop_str_in_output: the text ends with the stop string.
        included = {"include_stop_str_in_output": True}
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                          temperature=0, stop=[stop], stream=stream,
                                          extra_body=included)  # fmt: skip
        chunks = list(reply) if stream else [reply]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == expected + stop


def test_a_new_prompts_samples_report_none_of_it_cached(client):
    """The n samples of one prompt count its cached tokens as its least cached sample's:
    the others reuse the blocks the first computed (the last sample's count called a new
    prompt 96 of 101 tokens cached); asked again, the prompt is cached."""
    prompt = random_prompts((101,), seed=8108)[0]
    fresh = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3,
                                      temperature=1.0, seed=1)  # fmt: skip
    assert fresh.usage.prompt_tokens == 101
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3,
                                      temperature=1.0, seed=1)  # fmt: skip
    assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage


def live_leases(stack) -> int:
    """Prefill blocks held for decode workers, over every prefill worker."""
    return sum(stats.live_leases for stats in worker_stats(stack, "prefill"))


def test_a_client_gone_from_a_non_streaming_request_stops_its_generation(stack):
    aborted = lambda: metric(stack, "vllm:request_success_total", finished_reason="abort")  # noqa: E731
    aborted_before = aborted()
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 900,
                       "min_tokens": 900}).encode()  # fmt: skip
    host, port = stack.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while not sum(s.num_running for s in worker_stats(stack, "decode")):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    # 900 tokens take ~10 s on this model; a watched request is aborted within a second.
    deadline = time.monotonic() + 3
    while sum(s.num_running for s in worker_stats(stack, "decode")):
        assert time.monotonic() < deadline, "still generating for a client that left"
        time.sleep(0.1)
    # ... and the router counts it as aborted (its count may land a moment after the
    # worker stopped: the next test's counters once saw it move).
    assert eventually(lambda: aborted() == aborted_before + 1, timeout_s=5)


def test_the_router_bounds_heads_and_bodies(stack):
    """A head past 64 KiB is a 431 (the router's own protocol, ``router/http_protocol.py``);
    a body past ``router.max_request_bytes`` a 413 before it is read; the router serves on."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        with contextlib.suppress(OSError):  # the router closes while this still sends
            for _ in range(2048):  # past a first read that took it all
                sock.sendall(b"a" * 1024)
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 431")
    too_large = (32 << 20) + 1
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {too_large}\r\n\r\n".encode()
        )
        sock.settimeout(10)
        reply = sock.recv(65536)
        while b"router.max_request_bytes" not in reply and (more := sock.recv(65536)):
            reply += more
    assert reply.startswith(b"HTTP/1.1 413") and b"router.max_request_bytes" in reply
    assert get_json(f"{stack.base_url}/health")[0] == 200
    for status in ("431", "413"):  # counted with the router's other refusals
        assert metric(stack, "pdserve:requests_rejected_total", status=status) >= 1


def test_token_counters_move_as_tokens_stream_and_an_abandoned_stream_counts(stack):
    """vLLM's counters move as tokens come, and a sequence the client left counts too (as
    ``abort``): an API probe found them flat through a long stream, then one jump at its
    end, and nothing at all for an abandoned one."""
    prompt = random_prompts((30,), seed=91)[0]

    def counters() -> tuple[float, float, float]:
        return (metric(stack, "vllm:prompt_tokens_total"),
                metric(stack, "vllm:generation_tokens_total"),
                metric(stack, "vllm:request_success_total", finished_reason="abort"))  # fmt: skip

    prompt_before, generated_before, aborted_before = counters()
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": 900, "min_tokens": 900,
           "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(base_url=stack.base_url, headers=headers, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=ask) as reply,
    ):
        lines = reply.iter_lines()  # kept: a closed iterator closes the connection
        received = 0  # each chunk carries at least one token
        while received < 20:
            received += next(lines).startswith("data: {")
        prompt_now, generated_now, aborted_now = counters()
        assert prompt_now - prompt_before == len(prompt)
        assert generated_now - generated_before >= received
        assert aborted_now == aborted_before  # still running
    counted = eventually(lambda: counters()[2] != aborted_before, timeout_s=5)
    assert counted, "the abandoned stream was never counted"
    assert counters()[0] - prompt_before == len(prompt)


def test_a_choice_ended_by_its_first_token_frees_the_prefill_lease(stack, client):
    """A stop string in the token the prefill worker sampled ends the choice before any
    decode worker pulls the KV: the router releases the lease at once (lease_s is 4 here)."""
    prompt = random_prompts((40,), seed=83)[0]
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                     extra_body={"min_tokens": 3}).choices[0].text  # fmt: skip
    expired = sum(stats.leases_expired for stats in worker_stats(stack, "prefill"))
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      stop=[text[0]])  # fmt: skip
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == ""
    deadline = time.monotonic() + 3
    while live_leases(stack) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_leases(stack) == 0
    # Released, not run out (the slack above is for a loaded box, not for the expiry).
    assert sum(stats.leases_expired for stats in worker_stats(stack, "prefill")) == expired


def test_a_stop_token_ends_without_its_text_and_is_the_stop_reason(client, tiny_llama):
    """As in vLLM: the stop token's text is not output, and ``stop_reason`` names what
    stopped the choice; whether the prefill worker sampled that token or a decode worker
    did, streamed or not."""
    tokenizer = Tokenizer(tiny_llama)
    prompt = random_prompts((40,), seed=90)[0]
    ids = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    differed = 0
    for stop in (ids[0], ids[3]):
        expected = tokenizer.decode(ids[: ids.index(stop)])
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                  "extra_body": {"stop_token_ids": [stop], "ignore_eos": True}}  # fmt: skip
        whole = client.completions.create(**kwargs).choices[0]
        assert (whole.text, whole.finish_reason, whole.model_extra["stop_reason"]) == (
            expected, "stop", stop)  # fmt: skip
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
        assert "".join(c.text for c in chunks) == expected
        assert (chunks[-1].finish_reason, chunks[-1].model_extra["stop_reason"]) == ("stop", stop)
        # include_stop_str_in_output keeps the stop token's text, streamed or not.
        kwargs["extra_body"] = {**kwargs["extra_body"], "include_stop_str_in_output": True}
        included = tokenizer.decode(ids[: ids.index(stop) + 1])
        differed += included != expected  # (a token may decode to nothing on its own)
        whole = client.completions.create(**kwargs).choices[0]
        assert (whole.text, whole.model_extra["stop_reason"]) == (included, stop)
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
        assert "".join(c.text for c in chunks) == included
    assert differed  # the check above could tell the two apart
    length = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert length.choices[0].model_extra["stop_reason"] is None


def test_special_tokens_are_text_unless_skipped_but_not_the_ending_eos(client, tiny_llama):
    """vLLM's skip_special_tokens false: the special tokens the model writes are in the
    text; the EOS that ends it is not, unless include_stop_str_in_output; whether the
    prefill worker sampled that EOS or a decode worker did, streamed or not. stop_reason
    is None for the tokenizer's EOS, the id of generation_config's other one (vLLM)."""
    tokenizer = Tokenizer(tiny_llama)
    start, eos = tokenizer.token_id("<|im_start|>"), tokenizer.eos_token_id
    other_eos = tokenizer.token_id("<|im_end|>")  # generation_config: [</s>, <|im_end|>]
    prompt = random_prompts((30,), seed=91)[0]

    def texts(**extra) -> tuple[str, str, list[int], str, int | None]:
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                  "extra_body": {"return_token_ids": True, **extra}}  # fmt: skip
        whole = client.completions.create(**kwargs).choices[0]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            stream=True, **kwargs))  # fmt: skip
        return (whole.text, streamed, whole.model_extra["token_ids"], whole.finish_reason,
                whole.model_extra["stop_reason"])  # fmt: skip

    forced = {"logit_bias": {str(start): 100}, "ignore_eos": True}
    assert texts(**forced)[:2] == ("", "")
    assert texts(**forced, skip_special_tokens=False)[:2] == ("<|im_start|>" * 3,) * 2
    for end_id, reason in ((eos, None), (other_eos, other_eos)):
        for min_tokens in (0, 2):  # sampled by the prefill worker, then by a decode worker
            ending = {"logit_bias": {str(end_id): 100}, "min_tokens": min_tokens,
                      "skip_special_tokens": False}  # fmt: skip
            text, streamed, ids, finish, stop_reason = texts(**ending)
            assert (ids[-1], len(ids), finish, stop_reason) == (
                end_id, min_tokens + 1, "stop", reason)  # fmt: skip
            assert text == streamed == tokenizer.decode(ids[:-1], skip_special_tokens=False)
            text, streamed, ids, _, _ = texts(**ending, include_stop_str_in_output=True)
            assert text == streamed == tokenizer.decode(ids, skip_special_tokens=False)
            assert text.endswith(tokenizer.decode([end_id], skip_special_tokens=False))
    # With ignore_eos an EOS ends the output only as a grammar's last token: still no text.
    grammar = {"structured_outputs": {"grammar": f'start: "ab" <[{eos}]>'}}
    text, streamed, ids, finish, _ = texts(ignore_eos=True, skip_special_tokens=False, **grammar)
    assert (text, streamed, ids[-1], finish) == ("ab", "ab", eos, "stop")


def test_continuous_usage_stats_count_each_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="def main():", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5


def test_seeds_and_n(client):
    def sample(seed: int, n: int = 1):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12,
            temperature=1.0, top_p=0.9, seed=seed, n=n,
        )  # fmt: skip
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    two = sample(7, n=2)
    assert len(two) == 2 and two[0] == sample(7)[0] and two[0] != two[1]


def test_unseeded_samples_are_independent_across_workers(client):
    """Unseeded choices of one request run on different prefill workers (a prompt shorter
    than a block pulls no choice to a cache), whose engines would draw from identical
    generators (each seeds its own from engine.seed): choices came in pairs with the same
    first token. The router seeds each unseeded sequence itself, so they differ."""
    ask = dict(model=MODEL, prompt="hello", max_tokens=3, n=4, temperature=1.0,
               extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    runs = []
    for _ in range(3):
        choices = sorted(client.completions.create(**ask).choices, key=lambda c: c.index)
        runs.append([tuple(c.model_extra["token_ids"]) for c in choices])
        assert len(set(runs[-1])) == 4
    paired = [run[0][0] == run[1][0] and run[2][0] == run[3][0] for run in runs]
    assert not all(paired), runs  # (each pair matches by chance with p ~ 1/vocab)


def test_n_choices_pull_their_shared_prompt_once(stack, client, tiny_llama):
    """The choices of ``n > 1`` share one prompt: the decode worker pulls its full blocks
    once (the others wait for that pull and reuse the blocks) and each choice's partial
    last block; seeded choices still differ, and each is the offline engine's."""
    (prompt,) = random_prompts((200,), seed=85)  # 12 full blocks of 16 and 8 tokens
    before = sum(s.blocks_pulled for s in worker_stats(stack, "decode"))
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=4,
                                      temperature=1.0, seed=11,
                                      extra_body={"return_token_ids": True})  # fmt: skip
    pulled = sum(s.blocks_pulled for s in worker_stats(stack, "decode")) - before
    assert pulled <= 12 + 4, pulled  # not 4 x 13
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert len({tuple(c.model_extra["token_ids"]) for c in choices}) > 1
    llm = LLM(tiny_llama)
    for index, choice in enumerate(choices):  # the router's seed per choice (choices.py)
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + index)
        (offline,) = llm.generate([prompt], params, use_tqdm=False)
        assert choice.model_extra["token_ids"] == offline.outputs[0].token_ids


def test_logprobs(client):
    reply = client.completions.create(model=MODEL, prompt="def main():", max_tokens=5,
                                      temperature=0, logprobs=3)  # fmt: skip
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the top one
        assert token in top
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_error_codes(stack, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=5.0)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert "maximum context length" in long.value.message
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    # Values past what the gRPC fields hold: a 400 naming the field, not a 500.
    for param, value in [("max_tokens", 2**40), ("min_tokens", 2**40), ("top_k", 2**40),
                         ("seed", 2**63), ("stop_token_ids", [2**40])]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as huge:
            client.completions.create(model=MODEL, prompt="x", extra_body={param: value})
        assert huge.value.body["param"] == param, huge.value.body
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2,
                                      seed=2**63 - 1, temperature=1.0)  # fmt: skip
    assert len(reply.choices) == 2  # the second sample's seed wraps instead of overflowing
    with pytest.raises(openai.BadRequestError, match="chat templates"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"chat_template": "{{ 1 }}"})  # fmt: skip
    # Streamed, a bad request is still a 400 (the headers wait for the first event).
    with pytest.raises(openai.BadRequestError) as streamed:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"min_tokens": 5})  # fmt: skip
    assert streamed.value.body["param"] == "min_tokens"
    # OpenAI's shapes for the rest: no model means the served one; tool fields and stream
    # options without a stream are refused; JSON errors name no made-up field.
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{stack.base_url}/v1/completions"
    reply = httpx.post(url, headers=auth, json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert reply.status_code == 200 and reply.json()["model"] == MODEL
    chat = [{"role": "user", "content": "x"}]
    for extra in ({"tool_choice": "required"}, {"functions": [{"name": "f"}]},
                  {"stream_options": {"include_usage": True}}):  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=chat, extra_body=extra)
    for body, param in (
        (b'{"model": "tiny", "prompt": ', None),
        (b'{"model": "tiny", "prompt": null}', "prompt"),
    ):
        reply = httpx.post(url, content=body, headers=auth, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    with pytest.raises(openai.BadRequestError) as beyond_vocab:
        client.completions.create(model=MODEL, prompt="x", extra_body={"stop_token_ids": [10**6]})
    assert beyond_vocab.value.body["param"] == "stop_token_ids"


@pytest.mark.parametrize("constrained", [False, True])
def test_overload_is_429_with_retry_after(stack, aclient, constrained):
    """At most the limit (8) at once, also where admission awaits a constraint's compile
    (an audit found every request of a burst admitted across that await)."""
    extra = {"min_tokens": 200, **({"guided_regex": "[a-z ]*"} if constrained else {})}

    async def burst():
        async def one():
            try:
                await aclient.completions.create(model=MODEL, prompt="x", max_tokens=200,
                                                 extra_body=extra)  # fmt: skip
                return 200
            except openai.RateLimitError as exc:
                assert exc.response.headers["retry-after"]
                return 429

        return await asyncio.gather(*(one() for _ in range(14)))

    codes = asyncio.run(burst())
    assert 429 in codes and 0 < codes.count(200) <= 8


def test_admission_counts_sequences_not_requests(stack, client):
    """The limit (8 here) is on sequences: two streams of n=4 fill it, a third request is
    refused until they end, and one request asking for more than the limit is a 400."""
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=9)
    assert too_many.value.body["param"] == "n"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "x", "n": 4, "stream": True, "max_tokens": 400,
            "min_tokens": 400}  # fmt: skip
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=30) as http:
        with (
            http.stream("POST", "/v1/completions", json=body) as first,
            http.stream("POST", "/v1/completions", json=body) as second,
        ):
            assert first.status_code == second.status_code == 200
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        # Both streams are closed: their sequences are given back and aborted.
        deadline = time.monotonic() + 20
        while True:
            try:
                reply = client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=8)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "closed streams kept their admission"
                time.sleep(0.2)
    assert len(reply.choices) == 8


def test_shared_prefixes_stick_and_unrelated_load_spreads(stack, aclient):
    prefill_workers = [f"prefill@127.0.0.1:{stack.config['prefill']['port'] + 10 * i}"
                       for i in range(2)]  # fmt: skip

    def decisions() -> list[float]:
        return [metric(stack, "pdserve:routing_decisions_total", worker=w) for w in prefill_workers]

    async def run(prompts):
        await asyncio.gather(*(
            aclient.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
            for p in prompts
        ))  # fmt: skip

    # Two families of prompts, each sharing a 256-token prefix, sent one at a time.
    families = random_prompts((256, 256), seed=83)
    for family in families:
        before = decisions()
        for i in range(4):
            asyncio.run(run([family + [100 + i, 200 + i]]))
        moved = [a - b for a, b in zip(decisions(), before, strict=True)]
        assert sorted(moved) == [0, 4], f"a family was split across workers: {moved}"
    # Unrelated prompts in a burst use both workers.
    before = decisions()
    asyncio.run(run(random_prompts((64,) * 8, seed=84)))
    moved = [a - b for a, b in zip(decisions(), before, strict=True)]
    assert min(moved) >= 2, f"unrelated load did not spread: {moved}"


def test_killing_a_prefill_worker_loses_no_request(stack, aclient):
    """Runs last: it kills prefill-1."""
    prompts = random_prompts((48,) * 6, seed=85)

    async def load():
        async def one(prompt):
            reply = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                extra_body={"min_tokens": 24},
            )  # fmt: skip
            return reply.choices[0].finish_reason, reply.usage.completion_tokens

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.3)
        os.kill(stack.children()["prefill-1"], signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = asyncio.run(load())
    assert results == [("length", 24)] * len(prompts)
    # Afterwards everything goes to the surviving prefill worker.
    more = asyncio.run(load_after(aclient, random_prompts((48,) * 3, seed=86)))
    assert more == [("length", 4)] * 3


async def load_after(aclient, prompts):
    replies = await asyncio.gather(*(
        aclient.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                   extra_body={"min_tokens": 4})
        for p in prompts
    ))  # fmt: skip
    return [(r.choices[0].finish_reason, r.usage.completion_tokens) for r in replies]


def test_a_frozen_decode_worker_fails_its_streams_then_no_worker_is_a_status(stack, client):
    """Runs last: it freezes, then kills decode-0. A frozen worker (SIGSTOP: a hung device
    looks the same from outside) has its streams ended with an error event once it missed
    probes for worker_stall_timeout_s (2 s here), instead of hanging until the request
    timeout. Then, with no decode worker, what fails before the first token is an HTTP
    status (503, Retry-After) streamed or not, so clients' retry logic applies."""
    pid = stack.children()["decode-0"]
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=400, stream=True,
                                       extra_body={"min_tokens": 400})  # fmt: skip
    chunks = iter(stream)
    for _ in range(5):  # the decode worker is streaming
        next(chunks)
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        with pytest.raises(openai.APIError, match="stopped responding"):
            for _ in chunks:
                pass
        assert time.monotonic() - frozen_at < 10
    finally:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while get_json(f"{stack.base_url}/health")[0] != 503:  # the router noticed
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for stream in (True, False):
        with pytest.raises(openai.InternalServerError) as refused:
            reply = client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=stream)
            list(reply) if stream else None
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"]
        assert "127.0.0.1" not in refused.value.message  # no addresses in the message
