"""Tool calls by constraint: a chat request's ``tools`` with ``tool_choice`` naming a
function or ``"required"`` (vLLM's model-agnostic tool calling).

The output is constrained (``common/structured_output.py``) to what a call must be, so it
always parses, whatever the model's own call format:

- a named function: its arguments, as a JSON object of its ``parameters`` schema;
- ``"required"``: a JSON list of ``{"name": ..., "parameters": {...}}``, each one of the
  tools with its schema, at least one (exactly one without ``parallel_tool_calls``).

The reply carries them as OpenAI's ``tool_calls`` (``content`` null); ``"required"``
finishes with ``tool_calls`` (vLLM's choice), a named function with ``stop``. Text cut
short (``max_tokens``, a stop string) does not parse and is returned as ``content``, with
its own finish reason; only a named call's stream has by then sent the arguments so far
(they stream as generated, as in vLLM). The arguments are the text as generated, never
parsed and encoded again.
``"auto"`` reads calls from free text instead (``router/tool_parsers.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from common.structured_output import StructuredOutput
from router.protocol import ChatCompletionRequest, NamedToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_schemas(body: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """The parameters' schema of each function a request that must call may call:
    the one ``tool_choice`` names, or all its tools ("required")."""
    assert body.calls_tools and body.tools is not None
    named = body.tool_choice.name if isinstance(body.tool_choice, NamedToolChoice) else None
    return {t.function.name: t.function.parameters or ANY_OBJECT for t in body.tools
            if named in (None, t.function.name)}  # fmt: skip


class ToolCalls:
    """Tool calls by constraint, for one response: how its constrained text becomes
    OpenAI's ``tool_calls``, whole or streamed."""

    def __init__(self, named: str | None, structured: StructuredOutput) -> None:
        self.named = named  # the function tool_choice names; None: "required"
        self.structured: StructuredOutput | None = structured
        self._held: dict[int, str] = {}  # "required" calls by choice, until they parse

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolCalls | None:
        """None unless the request constrains its output to tool calls."""
        if not body.calls_tools:
            return None
        schemas = call_schemas(body)
        if isinstance(body.tool_choice, NamedToolChoice):
            name = body.tool_choice.name
            return cls(name, StructuredOutput("json", json.dumps(schemas[name])))
        calls = [
            {
                "type": "object",
                # The schema moves into the list: its local $refs must point where it is.
                "properties": {
                    "name": {"enum": [name]},
                    "parameters": _rebase(schema, f"#/items/anyOf/{i}/properties/parameters"),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for i, (name, schema) in enumerate(schemas.items())
        ]
        listed: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not body.parallel_tool_calls:
            listed["maxItems"] = 1
        return cls(None, StructuredOutput("json", json.dumps(listed)))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's ``tool_calls`` for a choice's text; None where it does not parse
        (cut short by ``max_tokens`` or a stop string)."""
        try:
            json.loads(text)
        except ValueError:
            return None
        if self.named is not None:  # the text is the arguments, as streamed
            return [call(self.named, text)]
        return [call(name, arguments) for name, arguments in _listed_calls(text)]

    def finish(self, finish_reason: str | None) -> str | None:
        """The choice's finish reason, once its calls are complete (``stop``):
        ``tool_calls`` for "required", ``stop`` for a named function (vLLM's)."""
        if finish_reason == "stop" and self.named is None:
            return "tool_calls"
        return finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason."""
        calls = self.calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, self.finish(
            finish_reason
        )

    def delta(
        self, index: int, text: str, first: bool, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A streamed choice's delta and finish reason: a named call streams its
        arguments as they come (its id and name first); "required" calls go out whole
        once the list parses."""
        finish = self.finish(finish_reason)
        if self.named is not None:
            if first:
                return {"content": None, "tool_calls": [call(self.named, text, index=0)]}, finish
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish
        held = self._held[index] = self._held.get(index, "") + text
        if not finish_reason:
            return {}, None
        calls = self.calls(held)
        if calls is None:  # cut short: the text as it is
            return {"content": held}, finish_reason
        indexed = [{"index": i, **c} for i, c in enumerate(calls)]
        return {"content": None, "tool_calls": indexed}, finish


# Keys whose values are data, not schemas: a "$ref" in them is not a reference.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#...``) made relative to ``base``, the
    place it is moved to (``#`` itself included: a recursive schema stays recursive)."""
    if isinstance(schema, list):
        return [_rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        else:
            rebased[key] = value if key in _DATA_KEYS else _rebase(value, base)
    return rebased


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _next(text: str, at: int) -> int:
    """Past the whitespace at ``at``, and past a comma or colon there (and its space)."""
    at = _SPACE.match(text, at).end()
    if at < len(text) and text[at] in ",:":
        at = _SPACE.match(text, at + 1).end()
    return at


def _members(text: str, at: int, closing: str) -> list[tuple[str | None, int, int]]:
    """(key, start, end) of each value of the array or object opening at ``at``: key
    None in an array. ``text`` is valid JSON (already parsed)."""
    members: list[tuple[str | None, int, int]] = []
    at = _next(text, at + 1)
    while text[at] != closing:
        key = None
        if closing == "}":
            key, at = _DECODER.raw_decode(text, at)
            at = _next(text, at)
        _, end = _DECODER.raw_decode(text, at)
        members.append((key, at, end))
        at = _next(text, end)
    return members


def _listed_calls(text: str) -> list[tuple[str, str]]:
    """(name, the parameters' own text) of each call of a "required" list. The text as
    generated, not parsed and encoded again: that would turn a number too large for a
    float into ``Infinity``, which is not JSON, and round the rest."""
    calls = []
    for _, start, _end in _members(text, _next(text, 0), "]"):
        fields = {key: (a, b) for key, a, b in _members(text, start, "}")}
        name = json.loads(text[slice(*fields["name"])])
        calls.append((name, text[slice(*fields["parameters"])]))
    return calls


def call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One of OpenAI's ``tool_calls`` (``index``: a stream delta's, by position)."""
    body: dict[str, Any] = {} if index is None else {"index": index}
    body.update(id=call_id(), type="function", function={"name": name, "arguments": arguments})
    return body
