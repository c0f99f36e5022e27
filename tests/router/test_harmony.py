"""GPT-OSS's Harmony replies: each message's header sends its body to the thinking, the
content or a tool call; where the reply starts comes from the prompt's end; streamed
deltas add up to the whole reply at any cut; reasoning tokens are the analysis messages'.
On the made GPT-OSS checkpoint: its tokenizer has the markers as special tokens, its
template ends in an open assistant header, and the detokenizer keeps the markers (and
only them) in the text. Such a checkpoint is read so with no parser configured, and a
text parser configured for it is a config error."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from common.config_base import ConfigError
from common.config_loader import load_config
from common.detokenizer import IncrementalDetokenizer
from common.model_info import model_info
from common.structured_output import GrammarCompiler, StructuredOutput
from common.tokenizer import Tokenizer
from router.choices import Choice, ChoiceEvent
from router.formatting import Formatter
from router.harmony import (
    MARKERS,
    Harmony,
    Kind,
    Opening,
    call_constraint,
    marker_ids,
    opening_of,
)
from router.state import harmony_ids_of

HEADER = Opening("header", header="assistant")  # the prompt ends with <|start|>assistant
ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')  # fmt: skip
# The recipient may come before the channel, and the content type without <|constrain|>.
CALL_ROLE_FIRST = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
                   ' {"zone": "CET"} <|call|>')  # fmt: skip

CASES = [  # text, calls allowed, (thinking, content, calls)
    (ANALYSIS + FINAL, True, ("The user asks for the weather.", "It is sunny in Paris.", [])),
    (
        ANALYSIS + CALL,
        True,
        ("The user asks for the weather.", None, [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "<|channel|>analysis<|message|>two<|end|>" + CALL + CALL_ROLE_FIRST,
        True,
        ("two", None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ),
    # A call the request does not allow is content: nothing the model wrote is lost.
    (ANALYSIS + CALL, False, ("The user asks for the weather.", '{"city": "Paris"}', [])),
    # A preamble (commentary, no recipient) is for the user; a built-in tool's call is not.
    (
        "<|channel|>commentary<|message|>Checking.<|end|>" + CALL,
        True,
        (None, "Checking.", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "<|channel|>analysis to=browser.search<|message|>{}<|end|>" + FINAL,
        True,
        ("{}", "It is sunny in Paris.", []),
    ),
    # No header at all (a constrained reply): content, up to the end marker.
    ('{"a": 1}<|return|>', True, (None, '{"a": 1}', [])),
    ("<|chan", True, (None, "<|chan", [])),  # never became a header: text
    # Cut short by max_tokens: the thinking is kept; a call cut short is content.
    ("<|channel|>analysis<|message|>half a thou", True, ("half a thou", None, [])),
    (
        ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"x"',
        True,
        ("The user asks for the weather.", '{"x"', []),
    ),
    (
        ANALYSIS + "<|start|>assistant<|channel|>fin",
        True,  # a header cut short
        ("The user asks for the weather.", None, []),
    ),
    # Text between messages is content; a next message ends a body that has no end.
    (
        ANALYSIS + "stray" + FINAL,
        True,
        ("The user asks for the weather.", "stray\nIt is sunny in Paris.", []),
    ),
    ("<|channel|>analysis<|message|>no end" + FINAL, True, ("no end", "It is sunny in Paris.", [])),
    # Messages of one kind are joined by a newline.
    (
        "<|channel|>commentary<|message|>Checking.<|end|>" + ANALYSIS + FINAL,
        True,
        ("The user asks for the weather.", "Checking.\nIt is sunny in Paris.", []),
    ),
    (
        ANALYSIS + "<|start|>assistant<|channel|>analysis to=python<|message|>1+1<|end|>" + FINAL,
        True,
        ("The user asks for the weather.\n1+1", "It is sunny in Paris.", []),
    ),
    # A header's marker inside a body is dropped, as decoding drops special tokens.
    ("x<|channel|>y<|message|><|constrain|>z<|end|>", True, (None, "xyz", [])),
    ("", True, (None, None, [])),
]


def _whole(text: str, calls: bool, opening: Opening = HEADER):
    message, finish_reason = Harmony(opening, calls).message(text, "stop")
    found = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    return (message.get("reasoning_content"), message["content"], found), finish_reason


@pytest.mark.parametrize(("text", "calls", "expected"), CASES)
def test_each_message_goes_where_its_header_says(text, calls, expected):
    parsed, finish_reason = _whole(text, calls)
    assert parsed == expected
    assert finish_reason == ("tool_calls" if expected[2] else "stop")
    message, _ = Harmony(HEADER, calls).message(text, "stop")
    assert message.get("reasoning") == message.get("reasoning_content")
    assert all(marker not in (message["content"] or "") for marker in ("<|end|>", "<|return|>"))


def _streamed(text: str, calls: bool, cuts: list[int], opening: Opening = HEADER):
    harmony = Harmony(opening, calls)
    thinking, content, found, indexes, finish_reason = "", "", [], [], None
    bounds = [0, *cuts, len(text)]
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        delta, finish_reason = harmony.delta(0, text[start:end], "stop" if last else None)
        thinking += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for tool_call in delta.get("tool_calls", []):
            indexes.append(tool_call["index"])
            found.append((tool_call["function"]["name"], tool_call["function"]["arguments"]))
    assert indexes == list(range(len(found)))
    return (thinking or None, content or None, found), finish_reason


@pytest.mark.parametrize(("text", "calls", "expected"), CASES)
def test_streamed_deltas_add_up_to_the_whole_reply_at_any_cut(text, calls, expected):
    rng = random.Random(len(text))
    whole = _whole(text, calls)
    cuts_list = [list(range(1, len(text)))]  # one character at a time
    cuts_list += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5)))
                  for _ in range(20) if len(text) > 1]  # fmt: skip
    for cuts in cuts_list:
        assert _streamed(text, calls, cuts) == whole, cuts


def test_a_stream_shows_no_marker_and_holds_back_only_what_may_begin_one():
    harmony = Harmony(HEADER, calls=True)
    delta, _ = harmony.delta(0, "<|channel|>final<|message|>Hello <|", None)
    assert delta == {"content": "Hello "}  # "<|" may begin <|return|>
    delta, _ = harmony.delta(0, "ret", None)
    assert delta == {}
    delta, _ = harmony.delta(0, "urn|>", "stop")
    assert delta == {}
    harmony = Harmony(HEADER, calls=True)
    delta, _ = harmony.delta(0, "<|channel|>analysis<|message|>hm <b>", None)
    assert delta == {"reasoning_content": "hm <b>", "reasoning": "hm <b>"}


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ("<|end|><|start|>assistant", Opening("header", header="assistant")),
        ("<|start|>assistant<|channel|>final<|message|>", Opening("body", kind=Kind.CONTENT)),
        ("<|start|>assistant<|channel|>analysis<|message|>", Opening("body", kind=Kind.THINKING)),
        ("<|start|>user<|message|>hi<|end|>", Opening("between")),
        ("no markers at all", Opening("between")),
    ],
)
def test_the_opening_comes_from_the_prompts_end(tail, expected):
    assert opening_of(tail, calls=True) == expected


def test_a_reply_begins_where_the_prompt_left_it():
    final_open = opening_of("<|start|>assistant<|channel|>final<|message|>", calls=True)
    assert _whole("Hi.<|return|>", True, final_open)[0] == (None, "Hi.", [])
    between = opening_of("<|return|>", calls=True)
    assert _whole(FINAL, True, between)[0] == (None, "It is sunny in Paris.", [])
    assert _whole("plain", True, between)[0] == (None, "plain", [])
    # Between messages, a header may leave its role out (a forced call after a prompt that
    # ends a message; a model that skips <|start|>assistant).
    called = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
    assert _whole(called, True, between)[0] == (None, None, [("f", "{}")])
    assert _whole(ANALYSIS + FINAL[len("<|start|>assistant") :], True)[0] == (
        "The user asks for the weather.", "It is sunny in Paris.", [])  # fmt: skip
    with_channel = Opening("header", header="assistant<|channel|>analysis")
    assert _whole("<|message|>hmm<|end|>", True, with_channel)[0] == ("hmm", None, [])


def test_include_reasoning_false_drops_the_thinking():
    message, _ = Harmony(HEADER, calls=True, include=False).message(ANALYSIS + FINAL, "stop")
    assert message == {"role": "assistant", "content": "It is sunny in Paris."}


def test_a_cut_reply_keeps_its_finish_reason():
    _, finish_reason = Harmony(HEADER, calls=True).message(ANALYSIS + CALL[:-8], "length")
    assert finish_reason == "length"


@pytest.fixture(scope="module")
def tokenizer(model_factory) -> Tokenizer:
    return Tokenizer(model_factory("gpt_oss"))


def test_the_made_checkpoint_writes_harmony(tokenizer, model_factory):
    ids = marker_ids(tokenizer)
    assert ids is not None and len(ids) == len(MARKERS)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    tail = tokenizer.decode(prompt[-8:], skip_special_tokens=False)
    assert opening_of(tail, calls=False) == HEADER
    config = json.loads((model_factory("gpt_oss") / "generation_config.json").read_text())
    assert {tokenizer.token_id("<|return|>"), tokenizer.token_id("<|call|>")} <= set(
        config["eos_token_id"]
    )
    llama = Tokenizer(model_factory("llama"))
    assert marker_ids(llama) is None


def test_the_detokenizer_keeps_the_markers_and_drops_other_special_tokens(tokenizer):
    keep = marker_ids(tokenizer)
    reply = ANALYSIS + FINAL
    token_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, keep_special=keep)
    text = "".join(detokenizer.add([t]) for t in token_ids) + detokenizer.finish()
    assert text == reply  # </s> (special, not a marker) dropped
    plain = IncrementalDetokenizer(tokenizer)
    text = "".join(plain.add([t]) for t in token_ids) + plain.finish()
    assert text == "analysisThe user asks for the weather.assistantfinalIt is sunny in Paris."


def test_reasoning_tokens_are_the_analysis_messages(tokenizer):
    analysis = tokenizer.encode(ANALYSIS, add_special_tokens=False)
    rest = tokenizer.encode(FINAL, add_special_tokens=False)
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in analysis + rest]
    harmony = Harmony(HEADER, calls=True)
    assert harmony.num_tokens(texts) == len(analysis)
    cut = len(analysis) - 2  # cut inside the thinking: all of it counts
    assert harmony.num_tokens(texts[:cut]) == cut
    assert harmony.num_tokens(texts[len(analysis) :]) == 0  # no thinking, with a header


def test_a_gpt_oss_checkpoint_is_read_in_harmony_with_no_parser_set(model_factory, tmp_path):
    """A text parser configured for it is a config error: at the router's start (through
    model_info, which every entry point reads) and in ``pdserve config check``."""
    gpt_oss = model_factory("gpt_oss")
    config = load_config(None, [f"model={gpt_oss}"])
    ids = harmony_ids_of(config, model_info(config), Tokenizer(gpt_oss))
    assert ids == marker_ids(Tokenizer(gpt_oss))
    for key, value in (("reasoning_parser", "qwen3"), ("tool_call_parser", "hermes")):
        overrides = [f"model={gpt_oss}", f"router.{key}={value}"]
        with pytest.raises(ConfigError, match=f"router.{key}: GPT-OSS writes the Harmony"):
            model_info(load_config(None, overrides))
        path = tmp_path / "config.yaml"
        path.write_text(f"model: {gpt_oss}\nrouter: {{{key}: {value}}}\n")
        checked = subprocess.run([sys.executable, "-m", "deploy.cli", "config", "check", str(path)],
                                 capture_output=True, text=True)  # fmt: skip
        assert checked.returncode == 2 and f"router.{key}: GPT-OSS" in checked.stderr
    llama = model_factory("llama")
    config = load_config(None, [f"model={llama}", "router.reasoning_parser=qwen3"])
    assert harmony_ids_of(config, model_info(config), Tokenizer(llama)) is None


def test_a_constraint_applies_to_the_final_answer_after_the_analysis(tokenizer, model_factory):
    """The grammar (llguidance, the made tokenizer): an analysis message, then the final
    header, then the constrained answer; or the final channel's header at once, then the
    answer (it went on at once, no Harmony, and the next turn's prompt, which renders the
    header, broke its prefix at the reply's first token). The markers are matched as
    tokens, so text that spells them cannot end the thinking."""
    compiler = GrammarCompiler(model_factory("gpt_oss"), tokenizer.vocab_size)
    structured = Harmony(HEADER, calls=False).constrained(StructuredOutput("regex", "[a-z]{2,5}"))
    assert (structured.reasoning_start, structured.reasoning_optional) == (
        "<|channel|>analysis<|message|>", True)  # fmt: skip

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(structured)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in token_ids) and matcher.is_accepting()

    thought = "<|channel|>analysis<|message|>let me see: assistant final<end> no<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>"
    assert accepts(thought + final + "abc")
    assert accepts("<|channel|>final<|message|>abc")
    assert not accepts("abc")
    assert not accepts(thought + final + "abcdefg")  # the answer is constrained
    assert not accepts(thought + "abc")  # no final header: no answer
    direct, _ = Harmony(HEADER, calls=False).message("<|channel|>final<|message|>abc<|return|>",
                                                     "stop")  # fmt: skip
    assert direct["content"] == "abc" and not direct.get("reasoning_content")
    message, _ = Harmony(HEADER, calls=False).message(thought + final + "abc<|return|>", "stop")
    assert (message["reasoning_content"], message["content"]) == (
        "let me see: assistant final<end> no",
        "abc",
    )
    # Where the prompt wrote more than the role, the constraint applies from the start.
    opened = Opening("body", kind=Kind.CONTENT)
    assert Harmony(opened, calls=False).constrained(structured) is structured


def test_a_call_goes_from_tokens_to_the_chat_reply(tokenizer):
    """Token ids through the router's own path (a detokenizer keeping the markers, a
    formatter reading Harmony), one token per event, then whole: the thinking and the
    call come out apart, the call's finish reason is tool_calls, the thinking's tokens
    are counted, and the EOS (<|call|>) is no text."""
    token_ids = tokenizer.encode(ANALYSIS + CALL, add_special_tokens=False)
    assert token_ids[-1] == tokenizer.token_id("<|call|>")
    keep = marker_ids(tokenizer)

    def formatter() -> Formatter:
        token_text = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        return Formatter("c", "m", chat=True, logprobs=None, token_text=token_text,
                         harmony=Harmony(HEADER, calls=True))  # fmt: skip

    request = SimpleNamespace(prompt_token_ids=[1, 2])
    detokenizer = IncrementalDetokenizer(tokenizer, keep_special=keep)
    choice = Choice(0, 0, request, detokenizer, token_ids=token_ids, finish_reason="stop")
    streamed, deltas = formatter(), []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        text = detokenizer.add([token_id]) + (detokenizer.finish() if last else "")
        event = ChoiceEvent(choice, text, [token_id], [], finish_reason="stop" if last else None)
        if (body := streamed.chunk(event)) is not None:  # (None: a marker, held back)
            deltas.append(body["choices"][0])
    thinking = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    assert thinking == "The user asks for the weather."
    assert not any(d["delta"].get("content") for d in deltas)
    (call,) = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert call["index"] == 0 and call["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}  # fmt: skip
    assert deltas[-1]["finish_reason"] == "tool_calls"

    body = formatter().final([choice])
    (item,) = body["choices"]
    assert item["finish_reason"] == "tool_calls"
    assert item["message"]["content"] is None
    assert item["message"]["reasoning_content"] == thinking
    assert [c["function"] for c in item["message"]["tool_calls"]] == [call["function"]]
    analysis_tokens = len(tokenizer.encode(ANALYSIS, add_special_tokens=False))
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == analysis_tokens


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip


def test_a_reply_that_must_call_calls_in_harmony(tokenizer, model_factory):
    """tool_choice "required" or a named function: the grammar lets the model think,
    then makes it call one of the functions, with arguments its schema allows, and end
    the call with <|call|>; the reply reads as that call."""
    compiler = GrammarCompiler(model_factory("gpt_oss"), tokenizer.vocab_size)
    schemas = {"get_weather": WEATHER, "get_time": {"type": "object"}}

    def accepts(structured: StructuredOutput, text: str) -> bool:
        matcher = compiler.matcher(structured)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in token_ids) and matcher.is_accepting()

    def calling(name: str, arguments: str) -> str:
        return (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                f"{arguments}<|call|>")  # fmt: skip

    required = call_constraint(schemas, tokenizer)
    thought = "<|channel|>analysis<|message|>call it<|end|><|start|>assistant"
    assert accepts(required, thought + calling("get_weather", '{"city": "Paris"}'))
    assert accepts(required, calling("get_time", "{}"))
    assert not accepts(required, calling("get_weather", '{"city": 1}'))  # the schema holds
    # json.dumps's separators, as the template prints the call back: no others.
    assert not accepts(required, calling("get_weather", '{"city":"Paris"}'))
    assert not accepts(required, calling("get_weather", '{"city":  "Paris"}'))
    assert not accepts(required, calling("get_date", "{}"))
    assert not accepts(required, thought)  # it must call
    assert not accepts(required, "<|channel|>final<|message|>no<|return|>")
    named = call_constraint({"get_time": {"type": "object"}}, tokenizer)
    assert not accepts(named, calling("get_weather", '{"city":"Paris"}'))

    harmony = Harmony(HEADER, calls=True, structured=required)
    assert harmony.constrained(required) is required  # its thinking is in it already
    message, finish_reason = harmony.message(thought + calling("get_time", "{}"), "stop")
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert (message["reasoning_content"], finish_reason) == ("call it", "tool_calls")
    named_reply = Harmony(HEADER, calls=True, structured=named, named=True)
    assert named_reply.message(calling("get_time", "{}"), "stop")[1] == "stop"  # as vLLM's


def test_a_stop_string_never_matches_inside_a_marker(tokenizer):
    """A stop string is matched on the reply's text, never inside a kept marker: one
    that spells a piece of one ("end") would cut the reply there and show the client
    half a marker."""
    reply = "<|channel|>final<|message|>The end.<|return|>"
    token_ids = tokenizer.encode(reply, add_special_tokens=False)
    for stop, shown in (("end", "The "), ("|>", "The end."), ("e", "Th")):
        detokenizer = IncrementalDetokenizer(tokenizer, [stop], keep_special=marker_ids(tokenizer))
        text = "".join(detokenizer.add([t]) for t in token_ids) + detokenizer.finish()
        message, _ = Harmony(HEADER, calls=False).message(text, "stop")
        assert message["content"] == shown, stop
