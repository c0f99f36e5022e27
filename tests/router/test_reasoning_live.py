"""Reasoning through a real ``pdserve up`` stack (router + 1 prefill + 1 decode worker) on
the made qwen3 model, whose template opens the thinking and whose tokenizer has the tags as
added tokens, with ``router.reasoning_parser: qwen3``. The random model rarely writes
``</think>`` by itself, so a logit bias makes it likely: the reply is checked against the
tokens it was made of, and those against the offline engine's."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from common.tokenizer import Tokenizer
from engine import LLM, SamplingParams
from tests.support.processes import write_config
from tests.support.stack import serving

MODEL = "thinker"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip
MESSAGES = [{"role": "user", "content": "How many legs has a spider?"}]


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("qwen3")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    config = write_config(
        tmp / "config.yaml",
        model_dir,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0,
                "reasoning_parser": "qwen3", "tool_call_parser": "hermes"},
    )  # fmt: skip
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return stack.openai_client()


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def _ask(tokenizer: Tokenizer, **extra) -> dict:
    (end_id,) = tokenizer.encode("</think>", add_special_tokens=False)
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "temperature": 1.0,
            "seed": 4, "logit_bias": {str(end_id): 6.0}, **extra}  # fmt: skip


def _streamed(client: openai.OpenAI, ask: dict) -> tuple[str, str, list[int]]:
    thinking, content, token_ids = "", "", []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra
            assert extra.get("reasoning_content", "") == extra.get("reasoning", "")
            thinking += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            token_ids += choice.model_extra.get("token_ids") or []
    return thinking, content, token_ids


def test_the_thinking_and_the_answer_split_where_the_tokens_say(client, tokenizer, model_dir):
    ask = _ask(tokenizer, extra_body={"return_token_ids": True})
    seen_answer = False
    for seed in (4, 5, 6):
        ask["seed"] = seed
        whole = client.chat.completions.create(**ask)
        reply = whole.choices[0]
        token_ids = reply.model_extra["token_ids"]
        text = tokenizer.decode(token_ids)
        thought, tag, answer = text.partition("</think>")
        message = reply.message.model_extra
        assert message.get("reasoning_content") == message.get("reasoning") == (thought or None)
        assert reply.message.content == ((answer or None) if tag else None)
        seen_answer |= bool(tag and answer.strip())
        (end_id,) = tokenizer.encode("</think>", add_special_tokens=False)
        thinking_tokens = token_ids.index(end_id) + 1 if tag else len(token_ids)
        assert whole.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
        # Streamed: the same tokens, the same split.
        assert _streamed(client, ask) == (thought, reply.message.content or "",
                                           reply.model_extra["token_ids"])  # fmt: skip
        # Disaggregated, the tokens are the offline engine's.
        prompt = tokenizer.apply_chat_template(MESSAGES)
        params = SamplingParams(
            max_tokens=32,
            temperature=1.0,
            seed=seed,
            logit_bias={int(k): v for k, v in ask["logit_bias"].items()},
        )
        (offline,) = LLM(model_dir).generate([prompt], params, use_tqdm=False)
        assert offline.outputs[0].token_ids == reply.model_extra["token_ids"]
    assert seen_answer  # one of them got past its thinking


def test_a_constraint_applies_after_the_thinking(client, tokenizer):
    ask = _ask(tokenizer, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "legs", "schema": SCHEMA}})  # fmt: skip
    for seed in (4, 5):
        ask["seed"] = seed
        message = client.chat.completions.create(**ask).choices[0].message
        jsonschema.validate(json.loads(message.content), SCHEMA)
        assert message.model_extra["reasoning_content"]
        thinking, content, _ = _streamed(client, ask)
        assert (thinking, content) == (message.model_extra["reasoning_content"], message.content)
    # A constraint whose own text starts with a blank: the answer keeps it (the audit's
    # case: it was stripped, and " yes" came back "yes").
    blank = _ask(tokenizer, max_tokens=48, extra_body={"structured_outputs": {
        "choice": [" yes", " no"]}})  # fmt: skip
    thoughts = []
    for seed in (2, 3, 4):
        blank["seed"] = seed
        message = client.chat.completions.create(**blank).choices[0].message
        assert message.content in (" yes", " no"), message
        thoughts.append(message.model_extra.get("reasoning_content"))
    assert any(thoughts)
    # Tool calls by constraint, after the thinking too.
    tool = {"type": "function", "function": {"name": "count", "parameters": SCHEMA}}
    ask = _ask(
        tokenizer, max_tokens=64, tools=[tool], tool_choice="required", parallel_tool_calls=False
    )
    reply = client.chat.completions.create(**ask).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (call,) = reply.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert reply.message.model_extra["reasoning_content"]


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(client, tokenizer):
    """``/v1/responses``: the chat reply's thinking as a reasoning item (its text as
    ``reasoning_text`` content), the answer as the message after it; streamed, the
    reasoning and text deltas add up to the same."""
    ask = _ask(tokenizer, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "legs", "schema": SCHEMA}})  # fmt: skip
    message = client.chat.completions.create(**ask).choices[0].message
    thinking = message.model_extra["reasoning_content"]
    text_format = {"type": "json_schema", "name": "legs", "schema": SCHEMA}
    request = {"model": MODEL, "input": MESSAGES[0]["content"], "max_output_tokens": 64,
               "temperature": 1.0, "text": {"format": text_format},
               "extra_body": {"seed": ask["seed"], "logit_bias": ask["logit_bias"]}}  # fmt: skip
    whole = client.responses.create(**request)
    reasoning, answer = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thinking
    assert answer.type == "message" and whole.output_text == message.content
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(**request, stream=True))
    streamed = {kind: "".join(e.delta for e in events if e.type == f"response.{kind}.delta")
                for kind in ("reasoning_text", "output_text")}  # fmt: skip
    assert streamed == {"reasoning_text": thinking, "output_text": message.content}
    assert events[-1].type == "response.completed"


def test_thinking_switched_off_or_left_out(client, tokenizer):
    """``enable_thinking: false`` closes the thinking in the prompt: all is content, a
    ``</think>`` the model writes included. ``include_reasoning: false`` leaves the
    thinking out and the answer as it was."""
    off = _ask(tokenizer, extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                      "return_token_ids": True})  # fmt: skip
    reply = client.chat.completions.create(**off).choices[0]
    assert "reasoning_content" not in reply.message.model_extra
    assert reply.message.content == tokenizer.decode(reply.model_extra["token_ids"])
    with_it = client.chat.completions.create(**_ask(tokenizer)).choices[0].message
    without = (
        client.chat.completions.create(**_ask(tokenizer, extra_body={"include_reasoning": False}))
        .choices[0]
        .message
    )
    assert with_it.model_extra["reasoning_content"]
    assert "reasoning_content" not in without.model_extra
    assert without.content == with_it.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            **_ask(tokenizer, extra_body={"chat_template_kwargs": {"messages": []}})
        )
    assert info.value.body["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("started", "inside"),
    [("<think>\nLet me count:", True), ("<think>Eight.</think>So", False),
     ([{"type": "text", "text": "<think>\nLet "}, {"type": "text", "text": "me count:"}], True)],
)  # fmt: skip
def test_a_continued_reply_goes_on_where_its_message_stopped(client, tokenizer, started, inside):
    """``continue_final_message``: a message that opened its thinking and left it open
    goes on thinking (it was read as answer, ``</think>`` and all: the audit's case); one
    that closed it goes on answering."""
    messages = [*MESSAGES, {"role": "assistant", "content": started}]
    ask = _ask(tokenizer, messages=messages, extra_body={
        "continue_final_message": True, "add_generation_prompt": False,
        "return_token_ids": True})  # fmt: skip
    reply = client.chat.completions.create(**ask).choices[0]
    text = tokenizer.decode(reply.model_extra["token_ids"])
    thought, tag, answer = text.partition("</think>") if inside else ("", "", text)
    assert "</think>" in text  # (the logit bias)
    assert reply.message.model_extra.get("reasoning_content") == (thought or None)
    assert reply.message.content == ((answer or None) if tag or not inside else None)
