"""Tool calls by constraint: schemas with local references keep them when moved into the
"required" list; the calls' arguments are the generated text, never re-encoded; a
"required" list cut short ends as text with its own finish reason, a named call cut short
as the call so far, streamed or not."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from llguidance import LLMatcher

from common.structured_output import GrammarCompiler
from common.tokenizer import Tokenizer
from proto import pdserve_pb2 as pb
from router.choices import Choice, ChoiceEvent
from router.formatting import Formatter
from router.protocol import ChatCompletionRequest
from router.tool_parsers import HermesCalls, MistralCalls
from router.tools import ToolCalls

REC = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
       "required": ["child"], "additionalProperties": False}  # fmt: skip
LOC = {"type": "object", "$defs": {"Loc": {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}},
    "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
    "additionalProperties": False}  # fmt: skip


def _required(*schemas: dict) -> ToolCalls:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
             for i, schema in enumerate(schemas)]  # fmt: skip
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools,
         "tool_choice": "required"})  # fmt: skip
    calls = ToolCalls.of(body)
    assert calls is not None
    return calls


def _named(schema: dict) -> ToolCalls:
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools,
         "tool_choice": {"type": "function", "function": {"name": "f"}}})  # fmt: skip
    calls = ToolCalls.of(body)
    assert calls is not None
    return calls


def _accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, calls: ToolCalls, text: str) -> bool:
    matcher: LLMatcher = compiler.matcher(calls.structured)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and (
        matcher.is_accepting()
    )


def test_local_refs_still_resolve_in_the_required_list(tiny_llama):
    """An audit found "#/$defs/..." refused (the pointer no longer existed) and "#"
    pointing at the whole list, which refused the tool's own valid arguments."""
    compiler, tokenizer = GrammarCompiler(tiny_llama, 2048), Tokenizer(tiny_llama)
    calls = _required(REC, LOC)
    assert _accepts(compiler, tokenizer, calls,
                    '[{"name": "f0", "parameters": {"child": {"child": null}}}, '
                    '{"name": "f1", "parameters": {"loc": {"city": "Rome"}}}]')  # fmt: skip
    assert not _accepts(compiler, tokenizer, calls,
                        '[{"name": "f0", "parameters": {"child": [{"name": "f0", '
                        '"parameters": {"child": null}}]}}]')  # fmt: skip
    assert not _accepts(compiler, tokenizer, calls,
                        '[{"name": "f1", "parameters": {"loc": {"city": "Oslo"}}}]')  # fmt: skip


def test_arguments_are_the_generated_text():
    """Parsed and encoded again, a number too large for a float became Infinity (not
    JSON); the text as generated is what the model wrote."""
    text = ('[{"name":"f0","parameters":{"x":2348100062500e1025211241}}, {"name" : "f1", '
            '"parameters" : {"s": "a,]}\\"", "y": 0.1000000000000000055}}]')  # fmt: skip
    calls = _required({"type": "object"}, {"type": "object"}).calls(text)
    assert calls is not None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f0", '{"x":2348100062500e1025211241}'),
        ("f1", '{"s": "a,]}\\"", "y": 0.1000000000000000055}'),
    ]


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_required_stream_cut_short_ends_as_text_with_its_own_reason(finish):
    """A stop string (or max_tokens) cut the list: the last delta is the text, and the
    finish reason is not tool_calls (an audit found "tool_calls" with no calls)."""
    calls = _required({"type": "object"})
    assert calls.delta(0, '[{"', True, None) == ({}, None)
    assert calls.delta(0, "na", False, finish) == ({"content": '[{"na'}, finish)
    whole = _required({"type": "object"}).message('[{"na', finish)
    assert whole == ({"role": "assistant", "content": '[{"na'}, finish)
    done = _required({"type": "object"})
    delta, reason = done.delta(0, '[{"name":"f0","parameters":{}}]', True, "stop")
    assert (
        reason == "tool_calls" and json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {}
    )


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_named_call_cut_short_is_the_call_so_far_streamed_or_not(finish):
    """The stream had sent the arguments as generated; the whole reply was plain text
    instead (an API probe found it; vLLM answers the call in both)."""
    streamed = _named({"type": "object"})
    first, _ = streamed.delta(0, '{"a":', True, None)
    last, reason = streamed.delta(0, "76", False, finish)
    assert reason == finish and first["content"] is None
    arguments = first["tool_calls"][0]["function"]["arguments"]
    arguments += last["tool_calls"][0]["function"]["arguments"]
    message, reason = _named({"type": "object"}).message('{"a":76', finish)
    assert reason == finish and message["content"] is None
    (call,) = message["tool_calls"]
    assert (
        call["function"]
        == {"name": "f", "arguments": arguments}
        == {"name": "f", "arguments": '{"a":76'}
    )


def test_a_required_stream_sends_no_empty_chunk_while_its_list_is_held():
    """The list goes out whole once it parses; the tokens before it made a chunk each
    with an empty delta (about one per token), which OpenAI and vLLM do not send.
    With log-probs asked for, each token's chunk carries them."""
    request = SimpleNamespace(prompt_token_ids=[7])
    pieces = ['[{"name":', '"f0","par', 'ameters":{}}]']
    for logprobs in (None, 0):
        formatter = Formatter("chat-1", "m", chat=True, logprobs=logprobs,
                              token_text=lambda token_id: "t",
                              tools=_required({"type": "object"}))  # fmt: skip
        choice = Choice(0, 0, request, None, token_ids=[1, 2, 3])
        bodies = [
            formatter.chunk(ChoiceEvent(choice, text, [i], [pb.TokenLogprobs(token_id=i)],
                                        "stop" if i == 3 else None))
            for i, text in enumerate(pieces, start=1)
        ]  # fmt: skip
        sent = [body["choices"][0] for body in bodies if body is not None]
        if logprobs is None:
            assert [c["delta"].keys() for c in sent] == [{"role"}, {"content", "tool_calls"}]
        else:
            assert len(sent) == 3 and all(c["logprobs"] is not None for c in sent)
        assert sent[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("parser", "pieces"),
    [(HermesCalls, ["<tool_call>", '{"name": "f", ', '"arguments": {}}', "</tool_call>"]),
     (MistralCalls, ["[TOOL_CALLS]", '[{"name": "f", ', '"arguments": {}}', "]"])],
)  # fmt: skip
def test_an_auto_stream_sends_no_empty_chunk_while_a_call_is_held(parser, pieces):
    """The free-text parsers ("auto") held a call's text back with an empty content,
    which made a chunk per token (37 of a 40-token Hermes reply); vLLM sends none."""
    request = SimpleNamespace(prompt_token_ids=[7])
    formatter = Formatter("chat-1", "m", chat=True, logprobs=None,
                          token_text=lambda token_id: "t", tools=parser())  # fmt: skip
    choice = Choice(0, 0, request, None, token_ids=list(range(1, len(pieces) + 1)))
    bodies = [
        formatter.chunk(ChoiceEvent(choice, text, [i], [pb.TokenLogprobs(token_id=i)],
                                    "stop" if i == len(pieces) else None))
        for i, text in enumerate(pieces, start=1)
    ]  # fmt: skip
    sent = [body["choices"][0] for body in bodies if body is not None]
    assert [c["delta"].keys() for c in sent] == [{"role"}, {"content", "tool_calls"}]
    assert sent[-1]["delta"]["content"] is None and sent[-1]["finish_reason"] == "tool_calls"
