"""Tool calls read from a model's free text, for ``tool_choice: "auto"``: the model
decides whether to call, in its family's own format (vLLM's ``--tool-call-parser``).
Seven formats:

``hermes`` (Qwen2.5 / Qwen3, NousResearch Hermes): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call
is the message's ``content``. One state machine reads a whole text and a stream alike, so
streamed deltas add up to the whole response: content goes out as it comes (holding back
only what may be the start of ``<tool_call>``), and each call once its closing tag
arrives. A call whose body is not such JSON, or one cut short, stays text, as vLLM's
parser leaves it; whitespace between calls is dropped.

``glm45`` (GLM-4.5 / 4.6): the same tags, but each call's body is the function's name on
its own line, then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` per argument (blanks
between allowed). A value is the argument's text when the tool's schema types it as a
string (GLM's template writes strings raw), else JSON (a value that is not JSON stays the
text). Read by the Hermes state machine, so it streams and fails alike.

``mistral`` (Mistral's instruct models): content, then ``[TOOL_CALLS]`` (a special token,
which the router's detokenizer keeps in the text for this parser) and the calls, in
either of Mistral's two formats: a JSON list of ``{"name": ..., "arguments": {...}}``
(tokenizers before v11: Mistral-7B-v0.3, Mixtral-8x22B, Mistral-Nemo), or
``NAME[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11 and later: Mistral
Small 3.2, Magistral, Devstral; a ``[CALL_ID]id`` after the name is the call's id). Ids
are nine letters or digits, the model's or new ones: Mistral's templates refuse others
when the call comes back. Content streams up to the marker; the calls are held to the end
and read whole; calls that do not parse are content, marker included, as the other
parsers leave a broken call as text.

``minimax_m2`` (MiniMax-M2): ``<minimax:tool_call>`` blocks, each holding one or more
``<invoke name="NAME">`` with a ``<parameter name="K">V</parameter>`` per argument, values
typed by the tool's schema as GLM's; the same state machine with its own tags.

``deepseek_v3`` (DeepSeek-V3 / R1 and V3.1): content, then the calls between
``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each in
``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``: V3 / R1 write ``function<｜tool▁sep｜>NAME``
and the arguments in a fenced ``json`` block, V3.1 ``NAME<｜tool▁sep｜>{...}``. Held and
read like Mistral's (the markers kept in the text when the tokenizer makes them special).

``kimi_k2`` (Kimi K2): the same shape with Kimi's markers: calls in a
``<|tool_calls_section_begin|>`` section, each ``<|tool_call_begin|>`` then its id
``functions.NAME:N`` (kept as the call's id: Kimi's template writes it back so),
``<|tool_call_argument_begin|>``, a JSON object and ``<|tool_call_end|>`` (one section
reader for both).

``llama3_json`` (Llama 3.1-3.3's JSON tool calling): a reply that calls is nothing but
calls, ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several joined by
``;``, after an optional ``<|python_tag|>`` (a special token, which decoding drops). A
reply whose first non-blank character is ``{`` is held until it ends, then read as calls;
if it does not parse as such it is content, whole. Any other reply streams as content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from common.router_config import ToolCallParser
from router.protocol import ChatCompletionRequest, FieldError, Tool
from router.tags import partial_tag
from router.tools import ToolCalls, call, json_members, mistral_call_id

START, END = "<tool_call>", "</tool_call>"
HERMES_MARKERS = (START, END)  # kept by the detokenizer where a tokenizer makes them special


def tool_format_of(
    body: ChatCompletionRequest, parser: ToolCallParser
) -> ToolCalls | HermesCalls | JsonCalls | MarkedCalls | None:
    """How a chat request's tool calls are made: by constraint ("required", a named
    function), parsed from free text ("auto" or unset, with a parser configured), or not
    at all. Raises ``FieldError`` for "auto" without a parser."""
    constrained = ToolCalls.of(body)
    if constrained is not None or not body.tools or body.tool_choice == "none":
        return constrained
    if parser is ToolCallParser.NONE:
        raise FieldError(
            'tool_choice "auto" (the default with tools) needs a parser for this model\'s '
            'own tool-call format (router.tool_call_parser, e.g. hermes); give "required", '
            'a named function, or "none"',
            "tool_choice",
        )
    if parser is ToolCallParser.MISTRAL:
        return MistralCalls()
    if parser is ToolCallParser.DEEPSEEK_V3:
        return DeepseekCalls()
    if parser is ToolCallParser.KIMI_K2:
        return KimiCalls()
    if parser is ToolCallParser.GLM45:
        return Glm45Calls(string_arguments(body.tools or []))
    if parser is ToolCallParser.MINIMAX_M2:
        return MinimaxCalls(string_arguments(body.tools or []))
    return HermesCalls() if parser is ToolCallParser.HERMES else JsonCalls()


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's body; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _name_and_arguments(value, ("arguments",), body)


def _name_and_arguments(
    value: Any, argument_keys: tuple[str, ...], text: str
) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object decoded from ``text``; None if it
    is not one. The arguments are under the first of ``argument_keys`` it has (none:
    ``{}``), as the model wrote them: decoded and encoded again, a number too large for
    a float became ``Infinity``, which is not JSON, and the rest were rounded."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    if key is None or value[key] is None:
        return value["name"], "{}"
    if isinstance(value[key], str):
        return value["name"], value[key]
    if not isinstance(value[key], dict):  # a list or a number is no function's arguments
        return None
    start = len(text) - len(text.lstrip())
    members = {k: (a, b) for k, a, b in json_members(text, start, "}")}
    return value["name"], text[slice(*members[key])]


def _one(parsed: tuple[str, str] | None) -> list[tuple[str, str]] | None:
    return None if parsed is None else [parsed]


def string_arguments(tools: list[Tool]) -> dict[str, frozenset[str]]:
    """Per function, the arguments its schema types as strings (GLM-4.5 writes those raw)."""
    strings = {}
    for tool in tools:
        properties = (tool.function.parameters or {}).get("properties") or {}
        strings[tool.function.name] = frozenset(
            name for name, schema in properties.items()
            if isinstance(schema, dict) and schema.get("type") == "string"
        )  # fmt: skip
    return strings


_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule (protocol.FunctionDefinition)
# The key without the blanks around it, the value as written.
_GLM_ARGUMENT = re.compile(
    r"\s*<arg_key>\s*(.*?)\s*</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S
)


def _parse_glm45_call(body: str, strings: dict[str, frozenset[str]]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a GLM-4.5 call's body; None if it is not one."""
    name, marker, rest = body.partition("<arg_key>")
    name = name.strip()
    if _FUNCTION_NAME.fullmatch(name) is None:
        return None
    # The body is stripped: every part of it after the name must be an argument.
    arguments = _text_arguments(marker + rest, _GLM_ARGUMENT, strings.get(name, frozenset()))
    return None if arguments is None else (name, arguments)


def _text_arguments(text: str, pattern: re.Pattern[str], strings: frozenset[str]) -> str | None:
    """The JSON object of the arguments written as text one after another in ``text``
    (GLM-4.5's, MiniMax-M2's), each a match of ``pattern`` (groups: key, value), blanks
    between; None if anything else is there. ``strings``: the keys the schema types as
    strings."""
    arguments: dict[str, str] = {}  # key -> its value as JSON text
    at = 0
    while at < len(text):
        match = pattern.match(text, at)
        if match is None:
            return None
        key = match.group(1)
        arguments[key] = _argument(match.group(2), key in strings)
        at = match.end()
    pairs = arguments.items()
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in pairs) + "}"


def _argument(value: str, is_string: bool) -> str:
    """An argument written as text (GLM-4.5's, MiniMax-M2's), as JSON text: a string of
    the text for a string-typed one, else the JSON value as written (a string of the
    text when it is not JSON)."""
    if not is_string:
        try:
            json.loads(value)
            return value.strip()
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


class _Blanks:
    """Whitespace next to a call goes with it, streamed or whole alike: the whitespace a
    piece of content ends with is held back, sent in front of the next text, dropped
    when a call follows (or when the reply ends after calls), and the whitespace right
    after a call is dropped. Decided per piece, whitespace arriving in a delta of its own
    was dropped after a call and kept otherwise, so the text depended on how the tokens
    came (every paragraph break after a call, gone one token at a time); and the whole
    reply stripped its content where the stream did not."""

    def __init__(self) -> None:
        self.held = ""
        self.after_call = False

    def text(self, text: str) -> str:
        """What of ``text`` to send now."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body

    def call(self) -> None:
        self.held, self.after_call = "", True

    def end(self, called: bool) -> str:
        """The rest, once the reply ended: nothing after calls."""
        rest, self.held = ("" if called else self.held), ""
        return rest


class _Reader:
    """One choice's text, read as it comes: the bodies between ``start`` and ``end`` tags
    by ``parse`` (the calls in one body, or None if it is not calls)."""

    def __init__(
        self, parse: Callable[[str], list[tuple[str, str]] | None], start: str, end: str
    ) -> None:
        self.parse, self.start, self.end = parse, start, end
        self.pending = ""
        # Inside a call: the text after ``pending``, kept as it came, and the last
        # ``len(end) - 1`` characters of all of it (where the end tag may begin). A long
        # call (an agent writing a file) grew one string and searched all of it at every
        # chunk, on the router's event loop: 3.4 s for a 256k-character call.
        self.pieces: list[str] = []
        self.tail = ""
        self.in_call = False
        self.num_calls = 0
        self.blanks = _Blanks()

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Content to send and calls completed by ``text`` (all of it when ``final``)."""
        start, end_tag = self.start, self.end
        if self.in_call and not final:
            window = self.tail + text
            if end_tag not in window:  # the call goes on: nothing to send
                self.pieces.append(text)
                self.tail = window[max(len(window) - len(end_tag) + 1, 0) :]
                return "", []
        if self.pieces:
            self.pending += "".join(self.pieces)
            self.pieces = []
        self.pending += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                at = self.pending.find(start)
                if at < 0:
                    keep = 0 if final else partial_tag(self.pending, start)
                    content.append(self.blanks.text(self.pending[: len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep :]
                    return self._sent(content, calls, final)
                content.append(self.blanks.text(self.pending[:at]))
                self.pending = self.pending[at + len(start) :]
                self.in_call = True
                continue
            end = self.pending.find(end_tag)
            if end < 0:
                if final:  # cut short: it stays text
                    content.append(self.blanks.text(start + self.pending))
                    self.pending = ""
                return self._sent(content, calls, final)
            body, self.pending = self.pending[:end], self.pending[end + len(end_tag) :]
            self.in_call = False
            parsed = self.parse(body.strip())
            if parsed is None:
                content.append(self.blanks.text(start + body + end_tag))
                continue
            calls.extend(call(*p) for p in parsed)
            self.num_calls += len(parsed)
            self.blanks.call()

    def _sent(
        self, content: list[str], calls: list[dict[str, Any]], final: bool
    ) -> tuple[str, list[dict[str, Any]]]:
        self.tail = self.pending[max(len(self.pending) - len(self.end) + 1, 0) :]
        if final:
            content.append(self.blanks.end(called=self.num_calls > 0))
        return "".join(content), calls


def _calling(
    content: str, calls: list[dict[str, Any]], finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole reply that called: its calls, the text around them as content (None if
    blank), and ``tool_calls`` for a reply that stopped by itself."""
    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _streamed(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed delta of text and calls: no content while text is held back (an empty
    delta sends no chunk, as vLLM sends none: an empty string went out for each token of
    a call), null beside calls."""
    if calls:
        return {"content": content or None, "tool_calls": calls}
    return {"content": content} if content else {}


class HermesCalls:
    """Hermes-format tool calls of one response (see the module docstring)."""

    structured = None  # nothing constrains the text

    def __init__(
        self,
        parse: Callable[[str], list[tuple[str, str]] | None] = lambda body: _one(_parse_call(body)),
        start: str = START,
        end: str = END,
    ) -> None:
        """``parse``: the calls of one body between the ``start`` and ``end`` tags."""
        self.parse, self.start, self.end = parse, start, end
        self._readers: dict[int, _Reader] = {}

    def _reader(self) -> _Reader:
        return _Reader(self.parse, self.start, self.end)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        reader = self._reader()
        content, calls = reader.feed(text, final=True)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return _calling(content, calls, finish_reason)

    def delta(
        self, index: int, text: str, first: bool, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        if index not in self._readers:
            self._readers[index] = self._reader()
        reader = self._readers[index]
        before = reader.num_calls
        content, calls = reader.feed(text, final=finish_reason is not None)
        delta = _streamed(content, [{"index": before + i, **c} for i, c in enumerate(calls)])
        if finish_reason == "stop" and reader.num_calls:
            finish_reason = "tool_calls"
        return delta, finish_reason


class Glm45Calls(HermesCalls):
    """GLM-4.5's tool calls of one response: Hermes' tags, GLM's bodies (module docstring).
    ``strings``: per function, the arguments its schema types as strings."""

    def __init__(self, strings: dict[str, frozenset[str]]) -> None:
        super().__init__(lambda body: _one(_parse_glm45_call(body, strings)))


MINIMAX_START, MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_MARKERS = (MINIMAX_START, MINIMAX_END)
_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>', re.S)
_PARAMETER = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>', re.S)


def _parse_minimax_calls(
    body: str, strings: dict[str, frozenset[str]]
) -> list[tuple[str, str]] | None:
    """The calls of a MiniMax-M2 ``<minimax:tool_call>`` body: ``<invoke name="NAME">``
    blocks of ``<parameter name="K">V</parameter>``, nothing else but blanks; None if it
    is not that."""
    calls, at = [], 0
    while at < len(body):
        invoke = _INVOKE.match(body, at)
        if invoke is None or _FUNCTION_NAME.fullmatch(invoke.group(1)) is None:
            return None
        name = invoke.group(1)
        arguments = _text_arguments(invoke.group(2).strip(), _PARAMETER,
                                    strings.get(name, frozenset()))  # fmt: skip
        if arguments is None:
            return None
        calls.append((name, arguments))
        at = invoke.end()
    return calls or None


class MinimaxCalls(HermesCalls):
    """MiniMax-M2's tool calls of one response (see the module docstring)."""

    def __init__(self, strings: dict[str, frozenset[str]]) -> None:
        super().__init__(lambda body: _parse_minimax_calls(body, strings), MINIMAX_START,
                         MINIMAX_END)  # fmt: skip


PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _json_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of a whole Llama 3 JSON reply; None if it is not calls."""
    text = text.strip()
    text = text.removeprefix(PYTHON_TAG).lstrip()
    calls, at = [], 0
    while True:
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            return None
        parsed = _name_and_arguments(value, ("parameters", "arguments"), text[at:end])
        if parsed is None:
            return None
        calls.append(call(*parsed))
        at = len(text) - len(text[end:].lstrip())
        if at == len(text):
            return calls
        if text[at] != ";":
            return None
        at = len(text) - len(text[at + 1 :].lstrip())


class JsonCalls:
    """Llama 3 JSON tool calls of one response (see the module docstring)."""

    structured = None  # nothing constrains the text

    def __init__(self) -> None:
        # By choice: the text held, in the pieces it came in (None: content, streamed),
        # and whether it is known to open calls (held to the end, joined once there).
        self._held: dict[int, list[str] | None] = {}
        self._calling: set[int] = set()
        # By choice, undecided: the held text without its leading blanks (what decides;
        # the whole was joined and stripped at every piece, quadratic in a long run of
        # blank lines).
        self._head: dict[int, str] = {}

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        calls = _json_calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def delta(
        self, index: int, text: str, first: bool, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        pieces = self._held.setdefault(index, [])
        if pieces is None:  # content: it streams
            return {"content": text}, finish_reason
        pieces.append(text)
        if finish_reason is None:
            if index in self._calling:
                return {}, None
            head = self._head[index] = (self._head.get(index, "") + text).lstrip()
            opens = _opens_calls(head)  # (the head is short until its first characters tell)
            if opens is not False:  # calls, or not yet known: held to the end
                if opens:
                    self._calling.add(index)
                return {}, None
            self._held[index] = None
            return {"content": "".join(pieces)}, None
        message, finish_reason = self.message("".join(pieces), finish_reason)
        delta = {"content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        return delta, finish_reason


def _opens_calls(text: str) -> bool | None:
    """Whether ``text`` begins as a Llama 3 JSON call does; None: too little to tell."""
    start = text.lstrip()
    if PYTHON_TAG.startswith(start):  # empty, or a piece of the tag
        return None
    rest = start.removeprefix(PYTHON_TAG).lstrip()
    if not rest:
        return None
    return rest.startswith("{")


TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MISTRAL_MARKERS = (TOOL_CALLS, ARGS, CALL_ID)  # special tokens the detokenizer keeps


def _mistral_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of what follows a reply's first ``[TOOL_CALLS]``; None if
    it is not calls."""
    if text.lstrip().startswith("["):  # before v11: one JSON list
        try:
            listed = json.loads(text)
        except ValueError:
            return None
        if not isinstance(listed, list) or not listed:
            return None
        spans = json_members(text, len(text) - len(text.lstrip()), "]")
        parsed = [_name_and_arguments(value, ("arguments", "parameters"), text[a:b])
                  for value, (_, a, b) in zip(listed, spans, strict=True)]  # fmt: skip
        if any(p is None for p in parsed):
            return None
        return [call(*p, id=mistral_call_id()) for p in parsed if p is not None]
    calls = []
    for piece in text.split(TOOL_CALLS):  # v11 and later: NAME[CALL_ID]id[ARGS]{...} per call
        head, found, arguments = piece.partition(ARGS)
        name, _, given_id = (part.strip() for part in head.partition(CALL_ID))
        try:
            value = json.loads(arguments) if found and name else None
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        known = len(given_id) == 9 and given_id.isascii() and given_id.isalnum()
        call_id = given_id if known else mistral_call_id()
        # (the arguments as written: see _name_and_arguments)
        calls.append(call(name, arguments.strip(), id=call_id))
    return calls


class _MarkedReader:
    """One choice's text, read as it comes: content up to ``marker``, then held to the end
    and read by ``parse`` (None: not calls, so the marker and all after it are text)."""

    def __init__(self, marker: str, parse: Callable[[str], list[dict[str, Any]] | None]) -> None:
        self.marker, self.parse = marker, parse
        self.pending = ""
        # What follows the marker, once it came, in the pieces it came in (joined at the
        # end: one string grown a chunk at a time is copied whole at every chunk).
        self.held: list[str] | None = None
        self.blanks = _Blanks()  # (the whitespace before the marker goes with the calls)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Content to send and the calls (all at the end, when ``final``)."""
        content = ""
        if self.held is None:
            self.pending += text
            at = self.pending.find(self.marker)
            if at < 0:
                keep = 0 if final else partial_tag(self.pending, self.marker)
                content = self.blanks.text(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return content + (self.blanks.end(called=False) if final else ""), []
            content = self.blanks.text(self.pending[:at])
            self.held = [self.pending[at + len(self.marker) :]]
        else:
            self.held.append(text)
        if not final:
            return content, []
        held = "".join(self.held)
        calls = self.parse(held)
        if calls is None:  # not calls: text, as the model wrote it
            text = self.blanks.text(self.marker + held) + self.blanks.end(called=False)
            return content + text, []
        self.blanks.call()
        return content, calls


class MarkedCalls:
    """Tool calls after a marker, held to the end and sent whole (Mistral's, DeepSeek's:
    see the module docstring)."""

    structured = None  # nothing constrains the text

    def __init__(self, marker: str, parse: Callable[[str], list[dict[str, Any]] | None]) -> None:
        self.marker, self.parse = marker, parse
        self._readers: dict[int, _MarkedReader] = {}

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = _MarkedReader(self.marker, self.parse).feed(text, final=True)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        return _calling(content, calls, finish_reason)

    def delta(
        self, index: int, text: str, first: bool, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        if index not in self._readers:
            self._readers[index] = _MarkedReader(self.marker, self.parse)
        content, calls = self._readers[index].feed(text, final=finish_reason is not None)
        delta = _streamed(content, [{"index": i, **c} for i, c in enumerate(calls)])
        if not calls:
            return delta, finish_reason
        return delta, "tool_calls" if finish_reason == "stop" else finish_reason


class MistralCalls(MarkedCalls):
    """Mistral-format tool calls of one response (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(TOOL_CALLS, _mistral_calls)


# DeepSeek's markers: fullwidth bars (U+FF5C) and lower-one-eighth blocks (U+2581).
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
DEEPSEEK_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)


def _section_calls(
    text: str,
    markers: tuple[str, str, str, str],  # section end, call begin, call end, separator
    read_call: Callable[[str, str], tuple[str, str] | tuple[str, str, str] | None],
) -> list[dict[str, Any]] | None:
    """The calls of a marked section (what follows its begin marker): calls up to the
    section's end marker, then nothing but blanks, each ``CALL_BEGIN head SEP arguments
    CALL_END`` read by ``read_call(head, arguments)`` as (name, arguments) or (name,
    arguments, the model's id for it); None if it is not that."""
    section_end, call_begin, call_end, separator = markers
    section, found, after = text.partition(section_end)
    pieces = section.split(call_begin)
    if not found or after.strip() or pieces[0].strip() or len(pieces) < 2:
        return None
    calls = []
    for piece in pieces[1:]:
        inner, found, between = piece.partition(call_end)
        head, sep, arguments = inner.partition(separator)
        parsed = read_call(head, arguments) if found and sep and not between.strip() else None
        if parsed is None:
            return None
        name, arguments, *given_id = parsed
        calls.append(call(name, arguments, id=given_id[0] if given_id else None))
    return calls


def _json_call(name: str, arguments: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) if ``name`` is a function's and ``arguments`` a JSON
    object; else None."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if _FUNCTION_NAME.fullmatch(name.strip()) is None or not isinstance(value, dict):
        return None
    return name.strip(), arguments.strip()  # (as written: see _name_and_arguments)


def _deepseek_call(head: str, arguments: str) -> tuple[str, str] | None:
    """V3 / R1's ``function`` head, the name and a fenced JSON block; V3.1's name head and
    a JSON object."""
    if head.strip() != "function":
        return _json_call(head, arguments)
    name, _, arguments = arguments.partition("\n")
    return _json_call(name, arguments.strip().removeprefix("```json").removesuffix("```"))


def _deepseek_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of what follows a reply's ``<｜tool▁calls▁begin｜>``."""
    return _section_calls(text, (CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP), _deepseek_call)


class DeepseekCalls(MarkedCalls):
    """DeepSeek-V3 / R1 / V3.1 tool calls of one response (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(CALLS_BEGIN, _deepseek_calls)


KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
KIMI_MARKERS = (KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_CALL_END,
                KIMI_ARGUMENTS)  # fmt: skip


def _kimi_call(call_id: str, arguments: str) -> tuple[str, str, str] | None:
    """Kimi K2 names a call ``functions.NAME:INDEX``: the function is NAME, the name its
    id (as vLLM's parser keeps it: Kimi's template writes it back into the prompt)."""
    given_id = call_id.strip()
    parsed = _json_call(given_id.partition(":")[0].removeprefix("functions."), arguments)
    return None if parsed is None else (*parsed, given_id)


def _kimi_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of what follows a reply's ``<|tool_calls_section_begin|>``."""
    markers = (KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGUMENTS)
    return _section_calls(text, markers, _kimi_call)


class KimiCalls(MarkedCalls):
    """Kimi K2's tool calls of one response (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(KIMI_SECTION_BEGIN, _kimi_calls)
