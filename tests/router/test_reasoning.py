"""Reasoning parsers: where the thinking starts (the prompt's end, then the parser), where
it ends, streamed deltas adding up to the whole reply at any cut, tool calls read from the
answer alone, and a constraint that applies after the thinking (its grammar, against
llguidance directly, on a tokenizer with the tags as added tokens and on one without)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from common.router_config import ReasoningParser
from common.structured_output import GrammarCompiler, StructuredOutput
from common.tokenizer import Tokenizer
from router.choices import Choice, ChoiceEvent
from router.formatting import Formatter
from router.reasoning import END, START, Opening, Reasoning, opening_of
from router.tool_parsers import HermesCalls
from router.tools import ToolCalls

R1, QWEN3 = ReasoningParser.DEEPSEEK_R1, ReasoningParser.QWEN3
THINKING, MAYBE, ANSWER = Opening.THINKING, Opening.MAYBE, Opening.ANSWER


@pytest.mark.parametrize(
    ("parser", "prompt_tail", "expected"),
    [
        (ReasoningParser.NONE, "assistant\n<think>\n", None),
        (R1, "<|im_start|>assistant\n", THINKING),  # R1 always thinks
        (QWEN3, "<|im_start|>assistant\n", MAYBE),  # Qwen3 thinks if it opens a block
        (R1, "assistant\n<think>\n", THINKING),  # the template opened it (Qwen3-Thinking)
        (QWEN3, "assistant\n<think>\n", THINKING),
        (QWEN3, "assistant\n<think>\n\n</think>\n\n", ANSWER),  # enable_thinking: false
        (R1, "assistant\n<think>\n\n</think>\n\n", ANSWER),
        (QWEN3, "user\nwhat is <think>? ok", MAYBE),  # a tag inside the text is no opening
    ],
)
def test_the_opening_comes_from_the_prompts_end_then_the_parser(parser, prompt_tail, expected):
    assert opening_of(parser, prompt_tail) is expected


CASES = [  # opening, text, (thinking, answer)
    (THINKING, "let me see</think>\n\nIt is 4.", ("let me see", "\n\nIt is 4.")),
    (THINKING, "<think>\nhmm</think>4", ("\nhmm", "4")),  # its own opening tag is dropped
    (THINKING, "still thinking when cut", ("still thinking when cut", None)),
    (THINKING, "a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
    (THINKING, "</think>  ", (None, "  ")),  # blanks are the answer's
    (THINKING, "", (None, None)),
    (MAYBE, "<think>x</think>\ny", ("x", "\ny")),
    (MAYBE, "no thinking </think> here", (None, "no thinking </think> here")),
    (MAYBE, " <think>not at the start</think>", (None, " <think>not at the start</think>")),
    (MAYBE, "<thi", (None, "<thi")),  # never became the tag: text
    (MAYBE, "", (None, "")),
    (ANSWER, "<think>a</think>b", (None, "<think>a</think>b")),
]


@pytest.mark.parametrize(("opening", "text", "expected"), CASES)
def test_a_whole_text_splits_at_the_first_end_tag(opening, text, expected):
    assert Reasoning(opening).split(text) == expected


@pytest.mark.parametrize(("opening", "text", "expected"), CASES)
def test_streamed_deltas_add_up_to_the_whole_split_at_any_cut(opening, text, expected):
    rng = random.Random(7)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        reasoning, thinking, answer = Reasoning(opening), "", ""
        for i, piece in enumerate(pieces):
            t, a = reasoning.delta(0, piece, final=i == len(pieces) - 1)
            assert START not in t and END not in t  # tags are never sent as thinking
            thinking, answer = thinking + t, answer + a
        assert (thinking, answer) == tuple(part or "" for part in expected)


def _choice(text: str, finish_reason: str = "stop") -> Choice:
    request = SimpleNamespace(prompt_token_ids=[1, 2])
    return Choice(0, 0, request, SimpleNamespace(text=text), token_ids=[5] * 4,
                  finish_reason=finish_reason)  # fmt: skip


def _stream(formatter: Formatter, pieces: list[str]) -> list[dict]:
    choice = _choice("".join(pieces))
    deltas = []
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        body = formatter.chunk(ChoiceEvent(choice, piece, [5], [], finish_reason=finish))
        if body is not None:  # (None: all of it held back, nothing to send)
            deltas.append(body["choices"][0])
    return deltas


def test_the_reply_carries_the_thinking_apart_and_reads_tool_calls_from_the_answer():
    """A Hermes call inside the thinking is thought, not called; the one in the answer is
    called; streamed, the thinking goes out as it comes, in both field names."""
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = f"maybe {call} then</think>\n\nSure.{call}"
    whole = Formatter("c", "m", chat=True, logprobs=None, token_text=str,
                      tools=HermesCalls(), reasoning=Reasoning(THINKING))  # fmt: skip
    (item,) = whole.final([_choice(text)])["choices"]
    message = item["message"]
    assert message["reasoning_content"] == message["reasoning"] == f"maybe {call} then"
    # (the blank line after the thinking is the answer's, as vLLM's parsers keep it)
    assert message["content"] == "\n\nSure." and len(message["tool_calls"]) == 1
    assert item["finish_reason"] == "tool_calls"

    streamed = Formatter("c", "m", chat=True, logprobs=None, token_text=str,
                         tools=HermesCalls(), reasoning=Reasoning(THINKING))  # fmt: skip
    pieces = [text[:12], text[12:30], text[30:-20], text[-20:]]
    deltas = _stream(streamed, pieces)
    assert deltas[0]["delta"] == {"reasoning_content": "maybe <tool_", "role": "assistant",
                                  "reasoning": "maybe <tool_"}  # fmt: skip
    thinking = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert (thinking, content.strip()) == (message["reasoning_content"], "Sure.")
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_a_named_call_streams_from_the_first_answer_chunk_not_the_first_chunk():
    tools = ToolCalls("f", StructuredOutput("json", "{}"))
    formatter = Formatter("c", "m", chat=True, logprobs=None, token_text=str,
                          tools=tools, reasoning=Reasoning(THINKING))  # fmt: skip
    deltas = _stream(formatter, ["hm", "m</think>", '{"x"', ": 1}"])
    assert [d["delta"].get("tool_calls") for d in deltas[:2]] == [None, None]
    first = deltas[2]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": '{"x"'} and first["id"]
    assert deltas[3]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": ": 1}"}}]


def test_include_reasoning_false_drops_the_thinking_and_keeps_the_answer():
    formatter = Formatter("c", "m", chat=True, logprobs=None, token_text=str,
                          reasoning=Reasoning(THINKING, include=False))  # fmt: skip
    message = formatter.final([_choice("secret</think>answer")])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "answer"}
    deltas = _stream(formatter, ["sec", "ret</think>ans", "wer"])
    assert [d["delta"] for d in deltas] == [
        {"role": "assistant"}, {"content": "ans"}, {"content": "wer"}
    ]  # fmt: skip


def test_a_constraint_after_the_thinking_is_wrapped_for_that_opening():
    structured = StructuredOutput("regex", "[a-z]+")
    assert Reasoning(ANSWER).constrained(structured) == structured
    assert Reasoning(THINKING).constrained(structured) == StructuredOutput(
        "regex", "[a-z]+", START, END, reasoning_optional=False
    )
    assert Reasoning(MAYBE).constrained(structured).reasoning_optional


def _accepts(compiler: GrammarCompiler, structured: StructuredOutput, token_ids: list[int]):
    """Whether the constraint's matcher takes ``token_ids`` and is then complete."""
    matcher = compiler.matcher(structured)
    for token_id in token_ids:
        if not matcher.consume_token(token_id):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_grammar_frees_the_thinking_and_constrains_the_answer(model_factory, arch):
    """qwen3's tags are added tokens (matched as tokens), llama's tokenizer spells them in
    pieces (matched as text): either way the thinking is free up to its first end tag,
    and the answer must match from the character after it."""
    model_dir = model_factory(arch)
    tokenizer = Tokenizer(model_dir)
    compiler = GrammarCompiler(model_dir, tokenizer.vocab_size)
    assert (len(tokenizer.encode(END, add_special_tokens=False)) == 1) == (arch == "qwen3")

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False})  # fmt: skip
    for kind, spec, good, bad in [
        ("json", schema, '{"a": 12}', '{"a": "x"}'),
        ("regex", "[a-z]{2,5}", "abc", "abcdefg"),
        ("choice", '["yes", " no"]', " no", "no"),  # an option's own blank is kept
        ("grammar", 'start: "(" /[0-9]+/ ")"', "(42)", "(4 2)"),
    ]:
        inside = StructuredOutput(kind, spec, START, END)
        optional = StructuredOutput(kind, spec, START, END, reasoning_optional=True)
        thought = "Hmm, { not json } [x] 12"
        assert _accepts(compiler, inside, ids(f"{thought}{END}{good}"))
        assert _accepts(compiler, inside, ids(f"{START}{thought}{END}{good}"))
        assert not _accepts(compiler, inside, ids(f"{thought}{END}{bad}"))
        assert not _accepts(compiler, inside, ids(f"{thought}{END}\n{good}"))  # not its own
        assert not _accepts(compiler, inside, ids(good))  # the thinking must end first
        assert not _accepts(compiler, inside, ids(f"a{END}b{END}{good}"))  # at the first
        assert _accepts(compiler, optional, ids(good))
        assert _accepts(compiler, optional, ids(f"{START}{thought}{END}{good}"))
        assert not _accepts(compiler, optional, ids(f" {good}"))
        assert not _accepts(compiler, optional, ids(f"{thought}{END}{good}"))


def test_the_eos_waits_for_the_answer(model_factory):
    model_dir = model_factory("qwen3")
    tokenizer = Tokenizer(model_dir)
    compiler = GrammarCompiler(model_dir, tokenizer.vocab_size)
    matcher = compiler.matcher(StructuredOutput("regex", "[a-z]{2,5}", START, END))
    for token_id in tokenizer.encode("thinking", add_special_tokens=False):
        assert matcher.consume_token(token_id)
    mask = matcher.compute_bitmask()
    eos = tokenizer.eos_token_id

    def allowed(token_id: int) -> bool:
        return bool(mask[token_id // 8] >> (token_id % 8) & 1)

    end_id = tokenizer.encode(END, add_special_tokens=False)[0]
    assert allowed(end_id) and not allowed(eos)


def test_a_reply_cut_inside_its_thinking_has_no_calls_streamed_or_whole():
    for tools in (ToolCalls("f", StructuredOutput("json", "{}")), HermesCalls()):
        formatter = Formatter("c", "m", chat=True, logprobs=None, token_text=str,
                              tools=tools, reasoning=Reasoning(THINKING))  # fmt: skip
        choice = _choice("still thinking", finish_reason="length")
        (item,) = formatter.final([choice])["choices"]
        assert item["message"] == {"role": "assistant", "content": None,
                                   "reasoning_content": "still thinking",
                                   "reasoning": "still thinking"}  # fmt: skip
        last = formatter.chunk(ChoiceEvent(choice, "still thinking", [5], [], "length"))
        delta = last["choices"][0]["delta"]
        assert "tool_calls" not in delta and "content" not in delta
        assert last["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("opening", "texts", "expected"),
    [
        (THINKING, ["ab", "c</th", "ink>", "\n\n", "de"], 3),  # the tag's last piece counts
        (THINKING, ["<think>", "ab", "</think>", "x"], 3),
        (THINKING, ["ab", "cd"], 2),  # cut inside the thinking: all of it
        (MAYBE, ["<think>", "a", "</think>", "b"], 3),
        (MAYBE, ["a", "</think>"], 0),
        (ANSWER, ["a", "</think>"], 0),
    ],
)
def test_usage_counts_the_thinkings_tokens(opening, texts, expected):
    token_text = dict(enumerate(texts)).get
    choice = _choice("".join(texts))
    choice.token_ids = list(range(len(texts)))
    formatter = Formatter("c", "m", chat=True, logprobs=None, token_text=token_text,
                          reasoning=Reasoning(opening))  # fmt: skip
    usage = formatter.final([choice, choice])["usage"]  # n = 2: both choices count
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * expected}
    plain = Formatter("c", "m", chat=True, logprobs=None, token_text=token_text)
    assert "completion_tokens_details" not in plain.final([choice])["usage"]
