"""Tool calls by constraint: a chat request's ``tools`` with ``tool_choice`` naming a
function or ``"required"`` (vLLM's model-agnostic tool calling).

The output is constrained (``common/structured_output.py``) to what a call must be, so it
always parses, whatever the model's own call format:

- a named function: its arguments, as a JSON object of its ``parameters`` schema;
- ``"required"``: a JSON list of ``{"name": ..., "parameters": {...}}``, each one of the
  tools with its schema, at least one (exactly one without ``parallel_tool_calls``).

The reply carries them as OpenAI's ``tool_calls`` (``content`` null); ``"required"``
finishes with ``tool_calls`` (vLLM's choice), a named function with ``stop``. Text cut
short by ``max_tokens`` does not parse and is returned as ``content``, with ``length``.
``"auto"`` reads calls from free text instead (``router/tool_parsers.py``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from common.structured_output import StructuredOutput
from router.protocol import ChatCompletionRequest, NamedToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


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
        assert body.tools is not None
        schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in body.tools}
        if isinstance(body.tool_choice, NamedToolChoice):
            name = body.tool_choice.name
            return cls(name, StructuredOutput("json", json.dumps(schemas[name])))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        listed: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not body.parallel_tool_calls:
            listed["maxItems"] = 1
        return cls(None, StructuredOutput("json", json.dumps(listed)))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's ``tool_calls`` for a choice's text; None where it does not parse
        (cut short by ``max_tokens`` or a stop string)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:  # the text is the arguments, as streamed
            return [call(self.named, text)]
        return [
            call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value
        ]

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


def call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One of OpenAI's ``tool_calls`` (``index``: a stream delta's, by position)."""
    body: dict[str, Any] = {} if index is None else {"index": index}
    body.update(id=call_id(), type="function", function={"name": name, "arguments": arguments})
    return body
