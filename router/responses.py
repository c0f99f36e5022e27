"""OpenAI's Responses API (``POST /v1/responses``) as a thin layer over chat completions.

A Responses request (``protocol.ResponsesRequest``) becomes a chat request
(``chat_request``): the ``instructions`` a system message first, ``input`` items chat
turns (messages, function calls and their outputs, reasoning given back), ``text.format``
the ``response_format``, ``reasoning.effort`` the ``reasoning_effort``, flat function
tools chat tools. The chat
path then does everything (templates, tools, reasoning, structured outputs, admission,
placement), and its reply is read back into Responses' shapes: a reasoning item (the
model's thinking, as ``reasoning_text`` content), a message item with the answer's
``output_text``, and a ``function_call`` item per tool call; streamed, the chat chunks
become Responses' semantic events (``ResponseStream``).

Stateless, as vLLM serves it without a store: nothing is kept after the reply, so
``previous_response_id`` and ``conversation`` (which need the earlier turns) and
``background`` are refused with a 400 naming the field, and every response says
``"store": false``; a client sends the whole conversation as ``input`` instead. Hosted
tools (web search, file search, MCP, ...) and non-text input (images, files) are refused
the same way. Reasoning comes whole as the item's content; ``summary`` stays empty.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import ValidationError

from router.errors import APIError, bad_request
from router.protocol import ChatCompletionRequest, FieldError, FunctionTool, ResponsesRequest

# Chat request fields as the Responses request names them, for errors the chat path
# raises (a 400's ``param`` must name what the client sent).
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The equivalent chat request. Raises ``FieldError`` naming ``body``'s field, or
    pydantic's ``ValidationError`` from the chat request's own checks (its fields map
    back through ``CHAT_TO_RESPONSES_PARAM``)."""
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
        **{name: getattr(body, name) for name in body.PASSED_ON},
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [_chat_tool(tool) for tool in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = _response_format(body.text.format)
    return ChatCompletionRequest.model_validate(chat)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    thinking: str | None = None  # a reasoning item, for the assistant turn after it
    for index, item in enumerate(body.input):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{index}]"
        if kind == "reasoning":
            thinking = _reasoning_text(item)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise FieldError(f"{where}.role must be one of {_MESSAGE_ROLES}", "input")
            message = {"role": role, "content": _text(item.get("content"), where)}
        elif kind == "function_call":
            call = {"id": _required(item, "call_id", where), "type": "function",
                    "function": {"name": _required(item, "name", where),
                                 "arguments": _required(item, "arguments", where)}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)  # calls of one turn
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _required(item, "call_id", where),
                       "content": _text(item.get("output"), where)}  # fmt: skip
        else:
            raise FieldError(
                f"{where}: items of type {kind!r} are not supported (message, "
                "function_call, function_call_output, reasoning)",
                "input",
            )
        if thinking is not None and message["role"] == "assistant":
            message["reasoning_content"] = thinking
        thinking = None
        messages.append(message)
    if not messages:
        raise FieldError("input must hold at least one message", "input")
    return messages


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """``chat_request(body)``, its failures as 400s naming this request's fields."""
    try:
        return chat_request(body)
    except FieldError as error:
        raise bad_request(str(error), error.param) from None
    except ValidationError as error:
        first = error.errors()[0]
        cause = first.get("ctx", {}).get("error")
        loc = first.get("loc", ())
        param = loc[0] if loc and isinstance(loc[0], str) else None
        if isinstance(cause, FieldError):
            param = cause.param
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        raise bad_request(message, responses_param(param)) from None


def responses_param(param: str | None) -> str | None:
    """A chat request's field as the Responses request names it."""
    return CHAT_TO_RESPONSES_PARAM.get(param, param) if param is not None else None


def renamed(error: APIError) -> APIError:
    """A 400 from the chat path, naming this request's field."""
    error.param = responses_param(error.param)
    return error


def _required(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError(f"{where}.{key} is required (a string)", "input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's (or a function output's) text: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise FieldError(
                f"{where}: content parts of type {kind!r} are not supported (text only)", "input"
            )
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any]) -> str | None:
    parts = item.get("content") or item.get("summary") or []
    texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
    return "".join(texts) or None


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    if tool.type != "function":
        raise FieldError(f"tools of type {tool.type!r} are not supported (function only)", "tools")
    if tool.name is None:
        raise FieldError("a function tool needs a name", "tools")
    function = {"name": tool.name, "description": tool.description,
                "parameters": tool.parameters, "strict": tool.strict}  # fmt: skip
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise FieldError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format`` (the schema is nested there)."""
    if text_format.get("type") != "json_schema":
        return text_format
    spec = {key: text_format[key] for key in ("name", "schema", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": spec}


class ResponseShape:
    """The response object around the output, from the request; ``resolved`` from a
    chat reply; ``events`` from a chat stream."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.body = body
        self.model = model

    def envelope(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        body = self.body
        text_format = (body.text.format if body.text else None) or {"type": "text"}
        reasoning = body.reasoning.model_dump() if body.reasoning else {"effort": None}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": reasoning,
            "store": False,
            "temperature": body.temperature,
            "text": {"format": text_format},
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def resolved(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion (one choice) as a response: the items its stream would
        have given (``ResponseStream``), the last one ``incomplete`` if the reply was cut."""
        [choice] = chat["choices"]
        message = choice["message"]
        status = _status(choice["finish_reason"])
        output = []
        thinking = message.get("reasoning_content")
        if thinking:
            output.append(_reasoning_item(_new_id("rs"), thinking))
        if message.get("content"):
            output.append(_message_item(_new_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            output.append(_call_item(_new_id("fc"), call["id"], function["name"],
                                     function["arguments"], "completed"))  # fmt: skip
        if not output:  # nothing at all was said: an empty answer
            output.append(_message_item(_new_id("msg"), "", "completed"))
        if "status" in output[-1]:
            output[-1]["status"] = status
        return self.envelope(status, output, _usage(chat.get("usage")))

    def events(self) -> ResponseStream:
        return ResponseStream(self)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": chat_usage["total_tokens"],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(key: str, text: str) -> dict[str, Any]:
    """The one content part of a streamed reasoning or message item."""
    return {"type": "reasoning_text", "text": text} if key == "reasoning" else _text_part(text)


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


class ResponseStream:
    """Chat chunks in, Responses events out (each a dict with ``type`` and
    ``sequence_number``). Items open as their first delta arrives and close when another
    kind begins or the stream ends: thinking, then the answer's text, then each call."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # closed items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._open_key: object = None  # "reasoning", "message" or ("call", chat index)
        self._finish_reason: str | None = None

    def start(self) -> Iterator[dict[str, Any]]:
        response = self.shape.envelope("in_progress", [])
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    def chunk(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat chunk (an error chunk ends the response as failed)."""
        if "error" in chunk:
            yield from self._close("incomplete")
            error = chunk["error"]
            yield self._event("error", code=error.get("code"), message=error.get("message"),
                              param=responses_param(error.get("param")))  # fmt: skip
            failed = self.shape.envelope("failed", self.output)
            failed["error"] = {"code": error.get("code") or "server_error",
                               "message": error.get("message", "")}  # fmt: skip
            yield self._event("response.failed", response=failed)
            return
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                yield from self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        if chunk.get("usage") is not None and not chunk.get("choices"):
            status = _status(self._finish_reason)
            if self._open is None and not self.output:  # nothing at all: an empty answer
                yield from self._open_text("message")
            yield from self._close(status)  # the last item: cut if the reply was
            response = self.shape.envelope(status, self.output, _usage(chunk["usage"]))
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield self._event(kind, response=response)

    def _text_delta(self, key: str, text: str) -> Iterator[dict[str, Any]]:
        if self._open_key != key:
            yield from self._close("completed")
            yield from self._open_text(key)
        assert self._open is not None
        self._open["_text"] += text
        kind = "response.reasoning_text.delta" if key == "reasoning" else (
            "response.output_text.delta")  # fmt: skip
        extra = {} if key == "reasoning" else {"logprobs": []}
        yield self._event(kind, item_id=self._open["id"], output_index=len(self.output),
                          content_index=0, delta=text, **extra)  # fmt: skip

    def _open_text(self, key: str) -> Iterator[dict[str, Any]]:
        """Announce a reasoning or message item and its one content part."""
        if key == "reasoning":
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
        else:
            item = _message_item(_new_id("msg"), None, "in_progress")
        yield from self._begin(key, item)
        yield self._event("response.content_part.added", item_id=item["id"],
                          output_index=len(self.output), content_index=0,
                          part=_part(key, ""))  # fmt: skip

    def _call_delta(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        key = ("call", call.get("index", 0))
        function = call.get("function") or {}
        if self._open_key != key:
            yield from self._close("completed")
            item = _call_item(_new_id("fc"), call.get("id") or _new_id("call"),
                              function.get("name") or "", "", "in_progress")  # fmt: skip
            yield from self._begin(key, item)
        assert self._open is not None
        arguments = function.get("arguments") or ""
        if arguments:
            self._open["_text"] += arguments
            yield self._event("response.function_call_arguments.delta",
                              item_id=self._open["id"], output_index=len(self.output),
                              delta=arguments)  # fmt: skip

    def _begin(self, key: object, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self._open, self._open_key = {**item, "_text": ""}, key
        yield self._event("response.output_item.added", output_index=len(self.output),
                          item=item)  # fmt: skip

    def _close(self, status: str) -> Iterator[dict[str, Any]]:
        """Finish the open item (``status``: completed, or incomplete where the reply was
        cut in it): its done events, and it joins the output."""
        if self._open is None:
            return
        item, key = self._open, self._open_key
        text = item.pop("_text")
        index = len(self.output)
        if key in ("reasoning", "message"):
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if key == "reasoning":
                yield self._event("response.reasoning_text.done", **where, text=text)
                done = _reasoning_item(item["id"], text)
            else:
                yield self._event("response.output_text.done", **where, text=text, logprobs=[])
                done = _message_item(item["id"], text, status)
            yield self._event("response.content_part.done", **where, part=_part(key, text))
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"], arguments=text)  # fmt: skip
            done = _call_item(item["id"], item["call_id"], item["name"], text, status)
        yield self._event("response.output_item.done", output_index=index, item=done)
        self.output.append(done)
        self._open = self._open_key = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event


def sse_event(event: dict[str, Any]) -> bytes:
    """One Responses event on the wire: its type as the SSE event name, then the JSON."""
    data = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def translate_stream(
    shape: ResponseShape, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """A chat completion's SSE body (one ``data:`` message per piece, then ``[DONE]``)
    as Responses events."""
    events = shape.events()
    try:
        for event in events.start():
            yield sse_event(event)
        async for piece in chunks:
            data = bytes(piece).decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            for event in events.chunk(json.loads(data)):
                yield sse_event(event)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
