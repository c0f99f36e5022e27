"""GPT-OSS's chat replies, read in its Harmony format: thinking, answer and tool calls.

GPT-OSS writes a reply as messages, each a header and a body between special tokens::

    <|channel|>analysis<|message|>The user wants the weather: call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

or, once it has what it needs, ``...<|channel|>final<|message|>It is sunny.<|return|>``
(the first message's ``<|start|>assistant`` is the chat template's generation prompt).
A reply is unreadable without the format, so the router reads it for every checkpoint
whose ``model_type`` is ``gpt_oss`` (and whose tokenizer has the markers as tokens), as
vLLM does, with no parser to configure. Each message goes to the chat reply by its
header:

- a recipient ``functions.NAME`` (``to=functions.NAME`` in the header): a tool call of
  NAME, its body the arguments, when the request has tools and ``tool_choice`` is not
  ``"none"`` (else the body is content: nothing the model wrote is lost);
- another recipient (a built-in tool, browser or python, which pdserve does not run; a
  tool's reply the model imagined): thinking;
- channel ``analysis``: thinking (``reasoning_content`` and ``reasoning``, as with the
  ``<think>`` parsers of ``router/reasoning.py``);
- channel ``final``, ``commentary`` with no recipient (a preamble meant for the user),
  or none: content.

Several messages of one kind are joined by a newline, as vLLM joins them. Text outside
any message is content: a reply with no header at all (a constrained one,
whose constraint applies from its first token, or a model that ignores the format) is
all content. A body ends at its end marker (``<|end|>``, ``<|return|>`` or ``<|call|>``),
or where a next message starts (``<|start|>``). Where the prompt leaves off (inside a
header, a body, or between messages) is read from its end, as ``router/reasoning.py``
does.

The markers are the tokenizer's special tokens: the router's detokenizer keeps these
(and drops any other special token) in a Harmony reply's text, and this reader takes
them out (a header's marker inside a body, which a well-formed reply never has, is
dropped, as plain decoding drops special tokens). One state machine reads a whole text
and a stream alike, so streamed deltas add up to the whole reply; it holds back what may
be the start of a marker, a header until its body begins, and a call until it ends. A
message cut short (``max_tokens``) keeps its thinking or content; a call cut short is
not a call, and its body goes to content (as ``router/tool_parsers.py`` leaves a cut
call as text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from common.structured_output import JSON_OPTIONS, StructuredOutput
from common.tokenizer import Tokenizer
from router.reasoning import reasoning_fields
from router.tags import partial_tag
from router.tools import call

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, RETURN, CALL = "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL)  # what ends a message
_BODY_ENDS = (*_ENDS, START)  # what ends a body (a next message, with no end marker)
_STRAY = (CHANNEL, MESSAGE, CONSTRAIN)  # header markers in a body: dropped, as decoding would
# A header longer than this without its <|message|> is not one (a channel, a recipient and
# a constraint take a few dozen characters).
_MAX_HEADER_CHARS = 4096
# How the header the prompt opens may begin (its role, ``assistant``, is in the prompt).
_OPENERS = (CHANNEL, CONSTRAIN, " to=", "to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."
# A constrained reply's thinking (``Harmony.constrained``): an analysis message, ended by
# the header of the final one, whose body is the constrained answer.
ANALYSIS = CHANNEL + "analysis" + MESSAGE
FINAL = CHANNEL + "final" + MESSAGE  # an answer with no analysis before it
THEN_FINAL = END + START + "assistant" + FINAL


def marker_ids(tokenizer: Tokenizer) -> frozenset[int] | None:
    """The ids of the Harmony markers, each one special token of ``tokenizer``; None if
    any is not (the tokenizer does not write the format)."""
    ids = tokenizer.special_token_ids(MARKERS)
    return frozenset(ids) if len(ids) == len(MARKERS) else None


def call_constraint(schemas: dict[str, dict[str, Any]], tokenizer: Tokenizer) -> StructuredOutput:
    """The grammar (llguidance's Lark; ``<[id]>`` is one token) of a reply that must
    call one of ``schemas`` (function name -> its parameters' JSON schema), for
    ``tool_choice`` "required" or a named function: an analysis message if the model
    writes one, then one call's message, its arguments matching the function's schema
    (as ``common/structured_output.py`` generates JSON: no free whitespace, json.dumps's
    separators, as the template prints the arguments back next turn), ended
    by ``<|call|>``, an end of sequence: a Harmony reply makes one call per turn."""
    token = {marker: f"<[{tokenizer.token_id(marker)}]>" for marker in MARKERS}
    alternatives = " | ".join(f"call{i}" for i in range(len(schemas)))
    rules = [
        "start: thinking? call",
        f'thinking: {token[CHANNEL]} "analysis" {token[MESSAGE]} TEXT {token[END]} '
        f'{token[START]} "assistant"',
        "TEXT: /(.|\\n)*/",
        f'call: {token[CHANNEL]} "commentary to={FUNCTIONS}" ({alternatives})',
    ]
    for i, (name, schema) in enumerate(schemas.items()):
        rules.append(f"call{i}: {json.dumps(name + ' ')} {token[CONSTRAIN]} \"json\" "
                     f"{token[MESSAGE]} arguments{i} {token[CALL]}")  # fmt: skip
        held = {**schema, "x-guidance": JSON_OPTIONS}  # (json.dumps's separators)
        rules.append(f"arguments{i}: %json {json.dumps(held)}")
    return StructuredOutput("grammar", "\n".join(rules))


class Kind(Enum):
    """Where a message's body goes."""

    THINKING = "thinking"
    CONTENT = "content"
    CALL = "call"


def _classify(header: str, calls: bool) -> tuple[Kind, str | None]:
    """(kind, function name for a call) of a message by its header."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        to = recipient.group(1)
        if not to.startswith(FUNCTIONS):
            return Kind.THINKING, None
        return (Kind.CALL, to[len(FUNCTIONS) :]) if calls else (Kind.CONTENT, None)
    channel = _CHANNEL.search(header)
    return (Kind.THINKING if channel and channel.group(1) == "analysis" else Kind.CONTENT), None


@dataclass(frozen=True, slots=True)
class Opening:
    """Where a reply begins, read from its prompt's end (``opening_of``)."""

    state: str  # "header", "body" or "between" (messages)
    header: str = ""  # the open header's text so far (state "header")
    kind: Kind = Kind.CONTENT  # the open body's (state "body")
    name: str | None = None

    @property
    def role_only(self) -> bool:
        """The prompt opened a header and wrote only its role (``<|start|>assistant``,
        the generation prompt): the reply writes the rest."""
        return self.state == "header" and not any(o.strip() in self.header for o in _OPENERS)


def opening_of(prompt_tail: str, calls: bool) -> Opening:
    """``prompt_tail``: the end of the prompt's text, markers kept. ``calls``: whether
    function calls are the request's (see the module docstring)."""
    at = prompt_tail.rfind(START)
    if at < 0:
        return Opening("between")
    header = prompt_tail[at + len(START) :]
    if any(end in header for end in _ENDS):
        return Opening("between")
    if MESSAGE in header:
        kind, name = _classify(header.split(MESSAGE, 1)[0], calls)
        return Opening("body", kind=kind, name=name)
    return Opening("header", header=header)


@dataclass(slots=True)
class Parts:
    """What a piece of a reply adds to its message."""

    thinking: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)


class _Reader:
    """One choice's text, read as it comes (see the module docstring)."""

    def __init__(self, opening: Opening, calls: bool) -> None:
        self.calls = calls
        self.state = opening.state
        self.header = opening.header
        # The header the prompt opened holds only the role: what follows must begin a
        # header (else the reply is bare content).
        self.check_opener = opening.role_only
        self.kind, self.name = opening.kind, opening.name
        self.pending = ""
        # A call's body in the pieces it came in, joined at its end (one string grown a
        # chunk at a time is copied whole at every chunk: quadratic in a long call).
        self.call_body: list[str] = []
        self.num_calls = 0
        self.num_messages = 0  # messages ended
        self.last_kind = Kind.CONTENT  # of the message that ended last
        self.written: set[Kind] = set()  # kinds some text went to
        self.fresh = True  # the open body has given no text yet

    def feed(self, text: str, final: bool) -> Parts:
        """What ``text`` adds (with all that is held, when ``final``)."""
        self.pending += text
        parts = Parts()
        while True:
            if self.state == "between":
                if self.pending.startswith(START):
                    self.pending = self.pending[len(START) :]
                    self.state, self.header = "header", ""
                    continue
                if self.pending.startswith(CHANNEL):  # a header whose role was left out
                    self.state, self.header = "header", ""
                    continue
                held = START.startswith(self.pending) or CHANNEL.startswith(self.pending)
                if not self.pending or (held and not final):
                    return parts
                self._open(Kind.CONTENT, None)  # text outside messages
            elif self.state == "header":
                if not self._read_header(final):
                    if final:  # a header cut short: no body to give
                        self.pending = ""
                    return parts
            elif not self._read_body(parts, final):
                return parts

    def _read_header(self, final: bool) -> bool:
        """Whether the header was settled (its body opened, or the reply found bare)."""
        if self.check_opener:
            text = self.pending
            if any(text.startswith(o) for o in _OPENERS):
                self.check_opener = False
            elif not final and (not text or any(o.startswith(text) for o in _OPENERS)):
                return False  # may still begin a header
            else:
                self._open(Kind.CONTENT, None)  # no header: the reply is bare content
                return True
        at = self.pending.find(MESSAGE)
        end, marker = _first_end(self.pending)
        if end >= 0 and (at < 0 or end < at):  # a header that ends with no body
            self.pending = self.pending[end + len(marker) :]
            self._ended(Kind.CONTENT)
            return True
        if at < 0:
            if len(self.pending) > _MAX_HEADER_CHARS:  # no header writes that much: the
                self._open(Kind.CONTENT, None)  # reply is bare content (searched whole at
                return True  # every piece, an endless one was quadratic)
            return False
        self._open(*_classify(self.header + self.pending[:at], self.calls))
        self.pending = self.pending[at + len(MESSAGE) :]
        return True

    def _read_body(self, parts: Parts, final: bool) -> bool:
        """Whether the body ended (the reader goes on between messages): at an end
        marker, or where a next message starts (a ``<|start|>``, left to begin it)."""
        at, marker = _first_end(self.pending, _BODY_ENDS)
        if at < 0:
            keep = 0 if final else max(partial_tag(self.pending, m) for m in MARKERS)
            cut = len(self.pending) - keep
            self._add(self.pending[:cut], parts)
            self.pending = self.pending[cut:]
            if final and self.kind is Kind.CALL:  # cut short: not a call
                self.kind, body, self.call_body = Kind.CONTENT, "".join(self.call_body), []
                self._add(body, parts)
            return False
        self._add(self.pending[:at], parts)
        self.pending = self.pending[at + (0 if marker == START else len(marker)) :]
        if self.kind is Kind.CALL:
            assert self.name is not None
            parts.calls.append((self.name, "".join(self.call_body).strip()))
            self.call_body = []
            self.num_calls += 1
        self._ended(self.kind)
        return True

    def _open(self, kind: Kind, name: str | None) -> None:
        self.state, self.kind, self.name = "body", kind, name
        self.fresh = True

    def _ended(self, kind: Kind) -> None:
        self.state, self.last_kind = "between", kind
        self.num_messages += 1

    def _add(self, text: str, parts: Parts) -> None:
        """A piece of the open body; its first text after another message's of the same
        kind starts with a newline."""
        for marker in _STRAY:
            text = text.replace(marker, "")
        if self.kind is Kind.CALL:
            self.call_body.append(text)
            return
        if not text:
            return
        if self.fresh and self.kind in self.written:
            text = "\n" + text
        self.fresh = False
        self.written.add(self.kind)
        if self.kind is Kind.THINKING:
            parts.thinking += text
        else:
            parts.content += text


def _first_end(text: str, ends: tuple[str, ...] = _ENDS) -> tuple[int, str]:
    """(index, marker) of the first of ``ends`` in ``text``; (-1, "") if none."""
    found = [(i, end) for end in ends if (i := text.find(end)) >= 0]
    return min(found) if found else (-1, "")


class Harmony:
    """The Harmony replies of one chat response's choices (see the module docstring).
    ``calls``: the request has tools and lets the model call them; ``include`` False
    (vLLM's ``include_reasoning``) drops the thinking from the reply. ``structured``: the
    constraint that makes the reply call (``call_constraint``), for "required" or a
    ``named`` function; a named call finishes with ``stop``, as vLLM's and OpenAI's."""

    def __init__(
        self,
        opening: Opening,
        calls: bool,
        include: bool = True,
        structured: StructuredOutput | None = None,
        named: bool = False,
    ) -> None:
        self.opening = opening
        self.calls = calls
        self.include = include
        self.structured = structured
        self.named = named
        self._readers: dict[int, _Reader] = {}

    def constrained(self, structured: StructuredOutput) -> StructuredOutput:
        """``structured`` applied to the final answer, after an analysis message if the
        model writes one (``common/structured_output.py``), where the prompt opens the
        reply's header; elsewhere it applies from the first token, and the reply is
        read as bare content."""
        if structured is self.structured or not self.opening.role_only:
            return structured  # the calls' grammar has the thinking in it already
        return replace(structured, reasoning_start=ANALYSIS, reasoning_end=THEN_FINAL,
                       reasoning_optional=True, reasoning_skip=FINAL)  # fmt: skip

    def _reader(self) -> _Reader:
        return _Reader(self.opening, self.calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason (``tool_calls`` where it called)."""
        parts = self._reader().feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": parts.content or None}
        if parts.calls:
            message["tool_calls"] = [call(name, arguments) for name, arguments in parts.calls]
            finish_reason = self._finish(finish_reason)
        message.update(reasoning_fields(parts.thinking, self.include))
        return message, finish_reason

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """Choice ``index``'s chunk delta for its new ``text``, and its finish reason."""
        reader = self._readers.get(index)
        if reader is None:  # (not setdefault: that built a reader for every piece)
            reader = self._readers[index] = self._reader()
        before = reader.num_calls
        parts = reader.feed(text, final=finish_reason is not None)
        delta: dict[str, Any] = {"content": parts.content} if parts.content else {}
        if parts.calls:
            delta["tool_calls"] = [
                call(name, arguments, before + i) for i, (name, arguments) in enumerate(parts.calls)
            ]
        if reader.num_calls:
            finish_reason = self._finish(finish_reason)
        delta.update(reasoning_fields(parts.thinking, self.include))
        return delta, finish_reason

    def _finish(self, finish_reason: str | None) -> str | None:
        """The finish reason of a reply that called."""
        return "tool_calls" if finish_reason == "stop" and not self.named else finish_reason

    def num_tokens(self, token_texts: list[str]) -> int:
        """How many of a choice's tokens are its thinking messages', markers included
        (OpenAI's ``completion_tokens_details.reasoning_tokens``)."""
        reader = self._reader()
        count = in_message = 0
        for text in token_texts:
            ended = reader.num_messages
            reader.feed(text, final=False)
            in_message += 1
            if reader.num_messages > ended:
                count += in_message if reader.last_kind is Kind.THINKING else 0
                in_message = 0
        open_thinking = reader.state == "body" and reader.kind is Kind.THINKING
        return count + (in_message if open_thinking else 0)
