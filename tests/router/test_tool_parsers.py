"""Tool calls read from free text (tool_choice "auto"), in the Hermes, Llama 3 JSON and
Mistral formats: a stream cut anywhere adds up to the whole response; what is not a
complete call stays text."""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import pytest

from common.config_loader import load_config
from common.detokenizer import IncrementalDetokenizer
from common.router_config import ToolCallParser
from common.tokenizer import Tokenizer
from router.choices import Choice, ChoiceEvent
from router.formatting import Formatter
from router.protocol import ChatCompletionRequest, FieldError
from router.state import tool_marker_ids_of
from router.tool_parsers import (
    DeepseekCalls,
    Glm45Calls,
    HermesCalls,
    JsonCalls,
    KimiCalls,
    MinimaxCalls,
    MistralCalls,
    tool_format_of,
)
from router.tools import ToolCalls

TWO_CALLS = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>\n'
)


def _streamed(
    text: str, cuts: list[int], finish: str, calls_only: bool = False, parser=HermesCalls
) -> tuple[str, list[dict], str | None]:
    """Content and calls a stream of ``text`` cut at ``cuts`` adds up to; with
    ``calls_only`` (every call well formed) no piece of a tag reaches the content."""
    calls = parser()
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, made, reason = "", [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, reason = calls.delta(0, piece, i == 0, finish if last else None)
        if calls_only:
            assert "<tool" not in (delta.get("content") or "")
        content += delta.get("content") or ""
        made += delta.get("tool_calls", [])
    return content, made, reason


def _names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_and_content_from_a_whole_text():
    message, reason = HermesCalls().message(TWO_CALLS, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me check both."
    weather = ("get_weather", {"city": "Paris", "days": [1, 2]})
    assert _names_and_arguments(message["tool_calls"]) == [weather, ("get_time", {"zone": "CET"})]
    for made in message["tool_calls"]:
        assert made["id"].startswith("chatcmpl-tool-") and "index" not in made


@pytest.mark.parametrize("seed", range(30))
def test_a_stream_cut_anywhere_adds_up_to_the_whole_response(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 40)))
    content, calls, reason = _streamed(TWO_CALLS, cuts, "stop", calls_only=True)
    whole, _ = HermesCalls().message(TWO_CALLS, "stop")
    assert reason == "tool_calls" and content == whole["content"]  # (not stripped)
    assert [c["index"] for c in calls] == [0, 1]
    assert _names_and_arguments(calls) == _names_and_arguments(whole["tool_calls"])


CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (f"\n\n{CALL}", None),  # Qwen3's answer after its thinking: a blank line, a call
        (f"{CALL}\nI called it.\n\nIt answers soon.\n", "I called it.\n\nIt answers soon."),
        (f"Let me look.\n{CALL}\n\n{CALL}", "Let me look."),
        (f"  Sure. {CALL}", "  Sure."),
    ],
)
def test_whitespace_next_to_a_call_goes_with_it_however_the_text_came(text, content):
    """Decided per delta, whitespace arriving alone after a call was dropped and kept
    otherwise (every paragraph break after a call, gone one token at a time), and the
    whole reply stripped its content where the stream did not. Whitespace on either side
    of a call goes with it; the rest is the content, streamed at any cut or whole."""
    whole, _ = HermesCalls().message(text, "stop")
    assert whole["content"] == content
    rng = random.Random(len(text))
    cuts_list = [list(range(1, len(text))), [text.index("<tool")], []]
    cuts_list += [sorted(rng.sample(range(1, len(text)), 6)) for _ in range(20)]
    for cuts in cuts_list:
        streamed, calls, _ = _streamed(text, cuts, "stop")
        assert (streamed or None) == content and calls, cuts


def test_arguments_are_passed_as_the_model_wrote_them():
    """Decoded and encoded again, a number too large for a float became ``Infinity``
    (not JSON) and the rest were rounded, in every free-text format."""
    arguments = '{"n": 1e400, "p": 0.30000000000000001}'
    texts = {
        HermesCalls: f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>',
        JsonCalls: f'{{"name": "f", "parameters": {arguments}}}',
        MistralCalls: f"[TOOL_CALLS]f[ARGS]{arguments}",
        KimiCalls: f"{SB}{KB}functions.f:0{KA}{arguments}{KE}{SE}",
    }
    for parser, text in texts.items():
        message, _ = parser().message(text, "stop")
        (made,) = message["tool_calls"]
        assert made["function"]["arguments"] == arguments, parser
    listed, _ = MistralCalls().message(f'[TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}]',
                                       "stop")  # fmt: skip
    assert listed["tool_calls"][0]["function"]["arguments"] == arguments
    glm, _ = Glm45Calls({}).message(
        "<tool_call>f<arg_key>n</arg_key><arg_value>1e400</arg_value>"
        "<arg_key>s</arg_key><arg_value>a b</arg_value></tool_call>", "stop"
    )  # fmt: skip
    assert glm["tool_calls"][0]["function"]["arguments"] == '{"n": 1e400, "s": "a b"}'


@pytest.mark.parametrize(
    "text",
    [
        "no calls here, just < and <tool and <tool_cal text",
        "<tool_call>not json</tool_call> after",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        'cut short <tool_call>{"name": "get_weather", "argu',
    ],
)
def test_what_is_not_a_complete_call_stays_text(text):
    message, reason = HermesCalls().message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"
    for cuts in ([1], list(range(1, len(text)))):  # two chunks; one character at a time
        content, calls, reason = _streamed(text, cuts, "length")
        assert (content, calls, reason) == (text, [], "length")


def _body(**fields) -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [tool], **fields})  # fmt: skip


def test_auto_needs_a_parser_and_the_others_do_not():
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(FieldError, match="router.tool_call_parser") as info:
            tool_format_of(_body(**choice), ToolCallParser.NONE)
        assert info.value.param == "tool_choice"
        assert isinstance(tool_format_of(_body(**choice), ToolCallParser.HERMES), HermesCalls)
        llama = tool_format_of(_body(**choice), ToolCallParser.LLAMA3_JSON)
        assert isinstance(llama, JsonCalls)
    assert tool_format_of(_body(tool_choice="none"), ToolCallParser.HERMES) is None
    required = tool_format_of(_body(tool_choice="required"), ToolCallParser.NONE)
    assert isinstance(required, ToolCalls) and required.structured is not None


def test_chat_chunks_carry_the_role_first_and_the_calls_with_their_indices():
    request = SimpleNamespace(prompt_token_ids=[1])
    choice = Choice(0, 0, request, SimpleNamespace(text=TWO_CALLS), token_ids=[1, 2],
                    logprobs=[], finish_reason="stop")  # fmt: skip
    formatter = Formatter("chatcmpl-1", "m", chat=True, logprobs=None, token_text=str,
                          tools=HermesCalls())  # fmt: skip
    half = len(TWO_CALLS) // 2
    first = formatter.chunk(ChoiceEvent(choice, TWO_CALLS[:half], [1], []))["choices"][0]
    last = formatter.chunk(ChoiceEvent(choice, TWO_CALLS[half:], [2], [], "stop"))["choices"][0]
    assert first["delta"]["role"] == "assistant" and "role" not in last["delta"]
    calls = first["delta"].get("tool_calls", []) + last["delta"].get("tool_calls", [])
    assert [c["index"] for c in calls] == [0, 1] and last["finish_reason"] == "tool_calls"
    whole = Formatter("chatcmpl-2", "m", chat=True, logprobs=None, token_text=str,
                      tools=HermesCalls()).final([choice])["choices"][0]  # fmt: skip
    assert whole["finish_reason"] == "tool_calls" and len(whole["message"]["tool_calls"]) == 2


@pytest.mark.parametrize(("parser", "text"), [(HermesCalls, TWO_CALLS), (JsonCalls, None)])
def test_without_parallel_tool_calls_a_choice_returns_its_first_call_only(parser, text):
    """``parallel_tool_calls: false``: a model writing two calls in free text gets its
    first one back, whole and streamed at every cut (OpenAI's contract; vLLM trims alike)."""
    text = text or LLAMA_CALLS
    request = SimpleNamespace(prompt_token_ids=[1])
    choice = Choice(0, 0, request, SimpleNamespace(text=text), token_ids=[1, 2],
                    logprobs=[], finish_reason="stop")  # fmt: skip

    def formatter(parallel: bool) -> Formatter:
        return Formatter("chatcmpl-1", "m", chat=True, logprobs=None, token_text=str,
                         tools=parser(), parallel_tool_calls=parallel)  # fmt: skip

    both = formatter(True).final([choice])["choices"][0]["message"]["tool_calls"]
    (first,) = formatter(False).final([choice])["choices"][0]["message"]["tool_calls"]
    assert len(both) == 2 and first["function"] == both[0]["function"]
    for cut in range(1, len(text)):
        streaming = formatter(False)
        chunks = [streaming.chunk(ChoiceEvent(choice, piece, [1], [], reason))["choices"][0]
                  for piece, reason in ((text[:cut], None), (text[cut:], "stop"))]  # fmt: skip
        calls = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
        assert [c["index"] for c in calls] == [0], cut
        assert calls[0]["function"] == first["function"]
        assert chunks[-1]["finish_reason"] == "tool_calls"


LLAMA_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
    '{"name": "get_time", "arguments": {"zone": "CET"}}'
)


@pytest.mark.parametrize("seed", range(20))
def test_llama3_json_calls_whole_and_streamed_at_any_cut(seed):
    message, reason = JsonCalls().message(LLAMA_CALLS, "stop")
    weather = ("get_weather", {"city": "Paris", "days": [1, 2]})
    assert _names_and_arguments(message["tool_calls"]) == [weather, ("get_time", {"zone": "CET"})]
    assert message["content"] is None and reason == "tool_calls"
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(LLAMA_CALLS)), rng.randint(1, 30)))
    content, calls, reason = _streamed(LLAMA_CALLS, cuts, "stop", parser=JsonCalls)
    assert (content, reason) == ("", "tool_calls")
    assert [c["index"] for c in calls] == [0, 1]
    assert _names_and_arguments(calls) == _names_and_arguments(message["tool_calls"])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine {not a call}",  # text first: content, streamed as it comes
        '  {"name": "f", "parameters": {}} and then words',  # a call, then more
        '{"parameters": {}}',  # no name
        '{"name": "f", "parameters": {"a": 1}}; ',  # a dangling separator
        '<|python_tag|>{"name": "f", "param',  # cut short
        "<|python_tag|>",
        "   ",
    ],
)
def test_llama3_json_what_is_not_calls_stays_text(text):
    message, reason = JsonCalls().message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"
    for cuts in ([1], list(range(1, len(text)))):
        content, calls, reason = _streamed(text, cuts, "length", parser=JsonCalls)
        assert (content, calls, reason) == (text, [], "length")


def test_llama3_json_plain_text_is_not_held_back():
    calls = JsonCalls()
    assert calls.delta(0, "  ", True, None) == ({}, None)  # blank: undecided
    assert calls.delta(0, "Sure", False, None) == ({"content": "  Sure"}, None)
    assert calls.delta(0, " {", False, None) == ({"content": " {"}, None)


MISTRAL_CASES = [  # text, (content, calls) of the whole reply
    # Before v11: one JSON list after the marker.
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        (None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ),
    # v11 and later: NAME[ARGS]{...} per call, each after its own marker (a [CALL_ID] dropped).
    (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}',
        ("Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ),
    ("No call here [TOOL_CALL] at all.", ("No call here [TOOL_CALL] at all.", [])),
    # Calls that do not parse (cut short, or not calls) are content, marker included.
    (
        'Hm.[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        ('Hm.[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),
    ),
    ('[TOOL_CALLS] [{"city": "Paris"}]', ('[TOOL_CALLS] [{"city": "Paris"}]', [])),
    ("[TOOL_CALLS]get_weather", ("[TOOL_CALLS]get_weather", [])),
]


def assert_marked_calls(parser, text: str, expected) -> None:
    """A marker-held parser's reading of ``text``, whole and streamed at any cut (every
    character alone, and 20 random 5-piece cuts), is ``expected`` (content, calls)."""
    message, reason = parser().message(text, "stop")
    content, calls = expected
    assert message["content"] == content
    assert _names_and_arguments(message.get("tool_calls", [])) == calls
    assert reason == ("tool_calls" if calls else "stop")
    rng = random.Random(len(text))
    cuts_list = [list(range(1, len(text)))]
    cuts_list += [sorted(rng.sample(range(1, len(text)), 4)) for _ in range(20)]
    for cuts in cuts_list:
        streamed, made, streamed_reason = _streamed(text, cuts, "stop", parser=parser)
        assert (streamed or None) == content if calls else streamed == content
        assert _names_and_arguments(made) == calls and streamed_reason == reason
        assert [c["index"] for c in made] == list(range(len(calls)))


@pytest.mark.parametrize(("text", "expected"), MISTRAL_CASES)
def test_mistral_calls_whole_and_streamed_at_any_cut(text, expected):
    assert_marked_calls(MistralCalls, text, expected)


def test_mistral_content_streams_up_to_the_marker():
    calls = MistralCalls()
    delta, _ = calls.delta(0, "Sure, [TOOL", True, None)
    # "[TOOL" may begin the marker; the blank waits for what follows (a call: dropped)
    assert delta == {"content": "Sure,"}
    delta, _ = calls.delta(0, "_CALLS]get_time[ARGS]{}", False, None)
    assert delta == {}  # held: no chunk (an empty content went out for every token)
    delta, reason = calls.delta(0, "", False, "stop")
    assert _names_and_arguments(delta["tool_calls"]) == [("get_time", {})]
    assert reason == "tool_calls"


def test_the_mistral_markers_reach_the_parser(model_factory):
    """The made Mistral tokenizer has the markers as special tokens, as Mistral's have:
    the router keeps them in the text for this parser (decoding drops them otherwise)."""
    mistral = model_factory("mistral")
    config = load_config(None, [f"model={mistral}", "router.tool_call_parser=mistral"])
    tokenizer = Tokenizer(mistral)
    keep = tool_marker_ids_of(config, tokenizer)
    assert keep == {tokenizer.token_id(m) for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}
    assert keep <= tokenizer.special_ids
    plain = load_config(None, [f"model={mistral}", "router.tool_call_parser=hermes"])
    assert tool_marker_ids_of(plain, tokenizer) == frozenset()
    text = 'Ok.[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == 'Ok.get_time{"zone": "CET"}'
    detokenizer = IncrementalDetokenizer(tokenizer, keep_special=keep)
    decoded = "".join(detokenizer.add([t]) for t in token_ids) + detokenizer.finish()
    message, _ = MistralCalls().message(decoded, "stop")
    assert _names_and_arguments(message["tool_calls"]) == [("get_time", {"zone": "CET"})]


GLM_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"},
                                         "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]  # fmt: skip
GLM_CALLS = (
    "I'll look both up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n<arg_key>zip"
    "</arg_key>\n<arg_value>75001</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>"
)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>",  # no name
        "<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call>",  # no value tags
        "<tool_call>get_weather stray text <arg_key>a</arg_key><arg_value>1</arg_value>"
        "</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value> after"
        "</tool_call>",
        "cut short <tool_call>get_weather\n<arg_key>city</arg_key><arg_val",
    ],
)
def test_glm45_what_is_not_a_complete_call_stays_text(text):
    message, reason = _typed_calls(ToolCallParser.GLM45).message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"


CB, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
B, E, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_CASES = [
    # V3 / R1: function<sep>NAME, then the arguments in a fenced json block.
    (
        f'Checking.{CB}{B}function{SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{E}'
        f"{B}function{SEP}get_time\n```json\n{{}}\n```{E}{CE}",
        ("Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ),
    # V3.1: NAME<sep>{...}.
    (
        f'{CB}{B}get_weather{SEP}{{"city": "Paris"}}{E}{CE}',
        (None, [("get_weather", {"city": "Paris"})]),
    ),
    ("No call <｜tool▁call here.", ("No call <｜tool▁call here.", [])),
    # Calls that do not parse (cut short, no end, not JSON, trailing text) are content.
    (f'Hm.{CB}{B}get_weather{SEP}{{"city": "Pa', (f'Hm.{CB}{B}get_weather{SEP}{{"city": "Pa', [])),
    (f"{CB}{B}get_weather{SEP}not json{E}{CE}", (f"{CB}{B}get_weather{SEP}not json{E}{CE}", [])),
    (
        f"{CB}{B}get_time{SEP}{{}}{E}{CE} and more",
        (f"{CB}{B}get_time{SEP}{{}}{E}{CE} and more", []),
    ),
    (f"{CB}{CE}", (f"{CB}{CE}", [])),
]


@pytest.mark.parametrize(("text", "expected"), DEEPSEEK_CASES)
def test_deepseek_calls_whole_and_streamed_at_any_cut(text, expected):
    assert_marked_calls(DeepseekCalls, text, expected)


def test_the_deepseek_markers_reach_the_parser(model_factory):
    """The made DeepSeek tokenizer has the markers as special tokens: the router keeps
    them in the text for this parser (decoding drops them otherwise)."""
    model_dir = model_factory("deepseek_v3")
    config = load_config(None, [f"model={model_dir}", "router.tool_call_parser=deepseek_v3"])
    tokenizer = Tokenizer(model_dir)
    keep = tool_marker_ids_of(config, tokenizer)
    assert keep == {tokenizer.token_id(m) for m in (CB, CE, B, E, SEP)} <= tokenizer.special_ids
    text = f'Ok.{CB}{B}get_time{SEP}{{"zone": "CET"}}{E}{CE}'
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert CB not in tokenizer.decode(token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, keep_special=keep)
    decoded = "".join(detokenizer.add([t]) for t in token_ids) + detokenizer.finish()
    message, _ = DeepseekCalls().message(decoded, "stop")
    assert message["content"] == "Ok."
    assert _names_and_arguments(message["tool_calls"]) == [("get_time", {"zone": "CET"})]


MINIMAX_CALLS = (
    'Checking both.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
    '<parameter name="city">Paris</parameter>\n<parameter name="days">[1, 2]</parameter>\n'
    '<parameter name="zip">75001</parameter>\n</invoke>\n<invoke name="get_time">\n'
    "</invoke>\n</minimax:tool_call>"
)


def _typed_calls(parser: ToolCallParser) -> object:
    """The request's parser for a reply to GLM_TOOLS (its string-typed arguments known)."""
    calls = tool_format_of(_body(tools=GLM_TOOLS), parser)
    assert isinstance(calls, {ToolCallParser.GLM45: Glm45Calls,
                              ToolCallParser.MINIMAX_M2: MinimaxCalls}[parser])  # fmt: skip
    return calls


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [(ToolCallParser.GLM45, GLM_CALLS, "I'll look both up."),
     (ToolCallParser.MINIMAX_M2, MINIMAX_CALLS, "Checking both.")],  # two invokes, one block
    ids=["glm45", "minimax_m2"],
)  # fmt: skip
@pytest.mark.parametrize("seed", range(20))
def test_typed_argument_calls_whole_and_streamed_at_any_cut(parser, text, content, seed):
    """GLM-4.5's and MiniMax-M2's calls write arguments as text: a string-typed argument
    stays text ("75001" is not the number 75001), others are JSON; a call without
    arguments has ``{}``; a stream cut anywhere gives the same."""
    message, reason = _typed_calls(parser).message(text, "stop")
    assert reason == "tool_calls" and message["content"] == content
    weather = ("get_weather", {"city": "Paris", "days": [1, 2], "zip": "75001"})
    assert _names_and_arguments(message["tool_calls"]) == [weather, ("get_time", {})]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
    streamed, calls, reason = _streamed(text, cuts, "stop", True,
                                        parser=lambda: _typed_calls(parser))  # fmt: skip
    assert reason == "tool_calls" and streamed.strip() == message["content"]
    assert _names_and_arguments(calls) == [weather, ("get_time", {})]
    assert [c["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize(
    "text",
    [
        '<minimax:tool_call><invoke name="get weather"></invoke></minimax:tool_call>',
        '<minimax:tool_call><invoke name="f"><parameter name="a">1</parameter> x</invoke>'
        "</minimax:tool_call>",
        '<minimax:tool_call>text <invoke name="f"></invoke></minimax:tool_call>',
        "<minimax:tool_call></minimax:tool_call>",
        'cut short <minimax:tool_call><invoke name="f"><parameter name="a">',
    ],
)
def test_minimax_m2_what_is_not_a_complete_call_stays_text(text):
    message, reason = MinimaxCalls({}).message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"


SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KB, KE, KA = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
KIMI_CASES = [
    (
        f'Checking.{SB}{KB}functions.get_weather:0{KA}{{"city": "Paris"}}{KE}'
        f"{KB}functions.get_time:1{KA}{{}}{KE}{SE}",
        ("Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ),
    (
        f'{SB}{KB}get_weather:0{KA}{{"city": "Paris"}}{KE}{SE}',
        (None, [("get_weather", {"city": "Paris"})]),
    ),
    ("No <|tool_calls_section here.", ("No <|tool_calls_section here.", [])),
    (f'Hm.{SB}{KB}functions.f:0{KA}{{"a": ', (f'Hm.{SB}{KB}functions.f:0{KA}{{"a": ', [])),
    (f"{SB}{KB}functions.f:0{KA}[1]{KE}{SE}", (f"{SB}{KB}functions.f:0{KA}[1]{KE}{SE}", [])),
    (f"{SB}{KB}functions.f:0{{}}{KE}{SE}", (f"{SB}{KB}functions.f:0{{}}{KE}{SE}", [])),
]


@pytest.mark.parametrize(("text", "expected"), KIMI_CASES)
def test_kimi_k2_calls_whole_and_streamed_at_any_cut(text, expected):
    """Kimi's call ids name the function (``functions.NAME:N``, or ``NAME:N``); arguments
    that are not a JSON object, a call without its argument marker, a section cut short
    stay text."""
    assert_marked_calls(KimiCalls, text, expected)
    assert isinstance(tool_format_of(_body(), ToolCallParser.KIMI_K2), KimiCalls)


def test_ids_the_models_templates_take_back():
    """A call goes back to the model in the next turn under the id the reply gave it:
    Mistral's templates refuse any id but nine letters or digits (ours were
    chatcmpl-tool-<hex>: every second turn a 400), and Kimi's writes its own
    ``functions.NAME:N`` into the prompt; so the model's ids are kept where it writes
    them, and Mistral's otherwise made so."""
    v11 = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
    ((kept,),) = [MistralCalls().message(v11, "stop")[0]["tool_calls"]]
    assert kept["id"] == "a1B2c3D4e"
    for text in ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                 '[TOOL_CALLS]get_weather[CALL_ID]too-long-id[ARGS]{"city": "Paris"}',
                 '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}, '
                 '{"name": "get_time", "arguments": {}}]'):  # fmt: skip
        made = [c["id"] for c in MistralCalls().message(text, "stop")[0]["tool_calls"]]
        assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in made), made
        assert len(set(made)) == len(made)
    kimi = (f'{SB}{KB}functions.get_weather:0{KA}{{"city": "Paris"}}{KE}'
            f"{KB}functions.f:1{KA}{{}}{KE}{SE}")  # fmt: skip
    ids = [c["id"] for c in KimiCalls().message(kimi, "stop")[0]["tool_calls"]]
    assert ids == ["functions.get_weather:0", "functions.f:1"]


@pytest.mark.parametrize("arguments", ["[1, 2]", "7", '"text"', "null"])
def test_arguments_that_are_no_object_are_no_call(arguments):
    """OpenAI's arguments are an object (or its JSON text): a list or a number made a
    call the client could not read; null is no arguments."""
    text = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    message, reason = HermesCalls().message(text, "stop")
    if arguments == "null":
        assert message["tool_calls"][0]["function"]["arguments"] == "{}"
    elif arguments == '"text"':  # a string stays the arguments' text, as before
        assert message["tool_calls"][0]["function"]["arguments"] == "text"
    else:
        assert message == {"role": "assistant", "content": text} and reason == "stop"


def test_hermes_tags_a_tokenizer_makes_special_reach_the_parser(model_factory, tmp_path):
    """Qwen's tokenizers keep <tool_call> plain text, but a checkpoint that makes it
    special lost it in decoding: the call came back as bare JSON content."""
    import shutil

    from tokenizers import Tokenizer as RustTokenizer

    qwen = model_factory("qwen3")
    made = tmp_path / "special-tags"
    shutil.copytree(qwen, made)
    rust = RustTokenizer.from_file(str(made / "tokenizer.json"))
    rust.add_special_tokens(["<tool_call>", "</tool_call>"])
    rust.save(str(made / "tokenizer.json"))
    tokenizer = Tokenizer(made)
    config = load_config(None, [f"model={made}", "router.tool_call_parser=hermes"])
    keep = tool_marker_ids_of(config, tokenizer)
    assert keep == {tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")}
    text = 'Ok.<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, keep_special=keep)
    decoded = "".join(detokenizer.add([t]) for t in token_ids) + detokenizer.finish()
    message, reason = HermesCalls().message(decoded, "stop")
    assert _names_and_arguments(message["tool_calls"]) == [("get_time", {"zone": "CET"})]
    assert (message["content"], reason) == ("Ok.", "tool_calls")
    assert (
        tool_marker_ids_of(
            load_config(None, [f"model={qwen}", "router.tool_call_parser=hermes"]), Tokenizer(qwen)
        )
        == frozenset()
    )  # plain text there: nothing to keep


def _long_call(kind: str, body: str):
    """A reader of ``kind`` and a reply whose one call writes ``body`` (the arguments'
    "text"), and how the reader takes a piece."""
    call = f'{{"name": "write", "arguments": {{"text": "{body}"}}}}'
    if kind == "harmony":
        from router.harmony import Harmony, Opening

        reader = Harmony(Opening("header", header="assistant"), calls=True)
        reply = ("<|channel|>commentary to=functions.write <|constrain|>json<|message|>"
                 + json.dumps({"text": body}) + "<|call|>")  # fmt: skip
        return reader, reply, lambda piece, at, end: reader.delta(0, piece, end)
    reader, reply = {
        "hermes": (HermesCalls(), f"<tool_call>{call}</tool_call>"),
        "mistral": (MistralCalls(), f"[TOOL_CALLS][{call}]"),
        "llama3_json": (JsonCalls(), call),
        "required": (ToolCalls(None, None), "[" + call.replace("arguments", "parameters") + "]"),
    }[kind]
    return reader, reply, lambda piece, at, end: reader.delta(0, piece, at == 0, end)


def _streamed_in(kind: str, num_chars: int) -> float:
    """CPU seconds to stream a call of ``num_chars`` characters through ``kind``'s reader
    in 4-character chunks (its arguments checked). This process's CPU time, not the
    wall clock: other processes on a loaded box stretch the one, not the other."""
    body = "x" * num_chars
    _, reply, feed = _long_call(kind, body)
    start = time.process_time()
    made = []
    for at in range(0, len(reply), 4):
        delta, _ = feed(reply[at : at + 4], at, "stop" if at + 4 >= len(reply) else None)
        made += delta.get("tool_calls", [])
    took = time.process_time() - start
    assert [json.loads(c["function"]["arguments"])["text"] for c in made] == [body]
    return took


@pytest.mark.parametrize("kind", ["hermes", "mistral", "llama3_json", "required", "harmony"])
def test_a_long_call_streams_in_time_linear_in_its_length(kind):
    """An agent writing a file as an argument: 2M characters in 4-character chunks. Each
    reader grew one string a chunk at a time (and Hermes searched all of it at every
    chunk), on the router's event loop: quadratic, 5.5-6.3 s at 1M already (Hermes 3.4 s
    at 256k); kept in pieces, the new text alone searched: 0.2-1.8 s here at 2M. Four
    times the text takes about four times as long (4.6x for Harmony; quadratic: 16x): a
    ratio, not a time, since a loaded CI box ran a linear reader past a bound in
    seconds (8.7 s against 6), and of CPU time (a wall-clock ratio read 8.3x there)."""
    quarter = _streamed_in(kind, 500_000)
    whole = _streamed_in(kind, 2_000_000)
    assert whole < 10 * quarter, (quarter, whole)


@pytest.mark.parametrize("kind", ["llama3_json", "harmony"])
def test_a_reply_that_never_decides_streams_in_linear_time(kind):
    """Degenerate replies a reader cannot place yet: 100k blank lines before a Llama 3
    reply's first character (the whole held text was joined and stripped at every piece:
    22 s), a Harmony header that never reaches ``<|message|>`` (searched whole at every
    piece: 40 s; past 4096 characters it is no header, and the reply bare content)."""
    if kind == "llama3_json":
        reader, feed = JsonCalls(), lambda piece, end: reader.delta(0, piece, False, end)
        pieces = ["\n\n"] * 100_000 + ["hello"]
    else:
        from router.harmony import Harmony, Opening

        reader = Harmony(Opening("header", header="assistant"), calls=True)
        feed = lambda piece, end: reader.delta(0, piece, end)  # noqa: E731
        pieces = ["<|channel|>analysis"] + [" word"] * 100_000
    start = time.perf_counter()
    content = "".join(feed(piece, None)[0].get("content") or "" for piece in pieces)
    content += feed(".", "length")[0].get("content") or ""
    took = time.perf_counter() - start
    assert content.endswith("word." if kind == "harmony" else "hello.")
    assert took < 4.0, took
