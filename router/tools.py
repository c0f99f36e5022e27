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
``"auto"`` is refused in ``router/protocol.py``: it needs a parser for each model family's
own call format.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from common.structured_output import StructuredOutput
from router.protocol import ChatCompletionRequest, NamedToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """How a request's constrained text becomes tool calls."""

    named: str | None  # the function tool_choice names; None: "required"
    structured: StructuredOutput

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

    @property
    def finish_reason(self) -> str:
        """What a choice whose calls are complete finishes with."""
        return "stop" if self.named else "tool_calls"

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
        """The choice's finish reason, once its calls are complete (``stop``)."""
        return self.finish_reason if finish_reason == "stop" else finish_reason


def call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One of OpenAI's ``tool_calls`` (``index``: a stream delta's, by position)."""
    body: dict[str, Any] = {} if index is None else {"index": index}
    body.update(id=call_id(), type="function", function={"name": name, "arguments": arguments})
    return body
