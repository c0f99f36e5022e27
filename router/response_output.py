"""Chat replies read back as Responses (``router/responses.py`` turns the request into a
chat request): a whole chat completion as a response object (``ResponseShape.resolved``),
and a chat stream's chunks as Responses' semantic events (``ResponseStream``,
``translate_stream``). Whole and streamed replies give the same items: a reasoning item
(the thinking as ``reasoning_text``), a message with the answer's ``output_text``, a
``function_call`` per call; the last one ``incomplete`` where the reply was cut.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from router.responses import responses_param
from router.responses_protocol import ResponsesRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
            "truncation": body.truncation,
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
            output.append(_message_item(_new_id("msg"), message["content"], "completed",
                                        _logprobs(choice)))  # fmt: skip
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


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _part(key: str, text: str) -> dict[str, Any]:
    """The one content part of a streamed reasoning or message item."""
    return {"type": "reasoning_text", "text": text} if key == "reasoning" else _text_part(text)


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) token log-probs: Responses' entries have chat's shape
    (token, logprob, bytes, top_logprobs)."""
    return (choice.get("logprobs") or {}).get("content") or []


def _message_item(item_id: str, text: str | None, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


class ResponseStream:
    """Chat chunks in, Responses events out (each a dict with ``type`` and
    ``sequence_number``). An item opens at its first delta. The thinking's item closes
    when the answer or a call begins (a client shows it done); the message and the calls
    stay open to the end of the reply, one message and one item per call, whatever the
    order of their pieces. Closing the message when a call began split the reply by how
    its text came in deltas: text after a call became a second message, and a word
    arriving in the call's chunk was cut over both (the whole response has one). Items
    are numbered as they open, so text written after a call follows it, where the whole
    response (from the chat message) puts the text first; thinking that resumes after
    the answer began (Harmony: analysis after a preamble) opens a second reasoning item,
    where the whole response joins them."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence_number = 0
        self._closed: list[tuple[int, dict[str, Any]]] = []  # (output index, item)
        self._open: dict[object, dict[str, Any]] = {}  # key -> item, in output order
        self._finish_reason: str | None = None
        # Token log-probs (asked for with include). A text delta carries every one not
        # sent yet (its chunk's, and those of chunks that showed no text: thinking, or
        # text held back), so the deltas add up to the finished text's: all the reply's
        # tokens up to it (all of them, as a whole reply's text, unless calls follow).
        self._logprobs: list[dict[str, Any]] = []
        self._unsent: list[dict[str, Any]] = []

    @property
    def output(self) -> list[dict[str, Any]]:
        """The closed items in output order (an item that opened earlier may close later:
        the message, around thinking that resumed)."""
        return [item for _, item in sorted(self._closed, key=lambda pair: pair[0])]

    def start(self) -> Iterator[dict[str, Any]]:
        response = self.shape.envelope("in_progress", [])
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    def chunk(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat chunk (an error chunk ends the response as failed)."""
        if "error" in chunk:
            yield from self._close_all("incomplete")
            error = chunk["error"]
            yield self._event("error", code=error.get("code"), message=error.get("message"),
                              param=responses_param(error.get("param")))  # fmt: skip
            failed = self.shape.envelope("failed", self.output)
            failed["error"] = {"code": _failed_code(error), "message": error.get("message", "")}
            yield self._event("response.failed", response=failed)
            return
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            self._unsent += _logprobs(choice)
            if delta.get("reasoning_content"):
                yield from self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text_delta("message", delta["content"], self._send_unsent())
            for call in delta.get("tool_calls") or ():
                yield from self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        if chunk.get("usage") is not None and not chunk.get("choices"):
            status = _status(self._finish_reason)
            if not self._open and not self.output:  # nothing at all: an empty answer
                yield from self._open_text("message")
            yield from self._close_all(status)  # the last item: cut if the reply was
            response = self.shape.envelope(status, self.output, _usage(chunk["usage"]))
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield self._event(kind, response=response)

    def _send_unsent(self) -> list[dict[str, Any]]:
        """The log-probs not sent yet, for a text delta; from now on the text's."""
        logprobs, self._unsent = self._unsent, []
        self._logprobs += logprobs
        return logprobs

    def _text_delta(
        self, key: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> Iterator[dict[str, Any]]:
        if key == "message":
            yield from self._close_thinking()
        if key not in self._open:
            yield from self._open_text(key)
        item = self._open[key]
        item["_text"] += text
        kind = "response.reasoning_text.delta" if key == "reasoning" else (
            "response.output_text.delta")  # fmt: skip
        extra = {} if key == "reasoning" else {"logprobs": logprobs or []}
        yield self._event(kind, item_id=item["id"], output_index=item["_index"],
                          content_index=0, delta=text, **extra)  # fmt: skip

    def _open_text(self, key: str) -> Iterator[dict[str, Any]]:
        """Announce a reasoning or message item and its one content part."""
        if key == "reasoning":
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
        else:
            item = _message_item(_new_id("msg"), None, "in_progress")
        yield from self._begin(key, item)
        yield self._event("response.content_part.added", item_id=item["id"],
                          output_index=self._open[key]["_index"], content_index=0,
                          part=_part(key, ""))  # fmt: skip

    def _call_delta(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        key = ("call", call.get("index", 0))
        function = call.get("function") or {}
        yield from self._close_thinking()
        if key not in self._open:
            item = _call_item(_new_id("fc"), call.get("id") or _new_id("call"),
                              function.get("name") or "", "", "in_progress")  # fmt: skip
            yield from self._begin(key, item)
        item = self._open[key]
        arguments = function.get("arguments") or ""
        if arguments:
            item["_text"] += arguments
            yield self._event("response.function_call_arguments.delta",
                              item_id=item["id"], output_index=item["_index"],
                              delta=arguments)  # fmt: skip

    def _close_thinking(self) -> Iterator[dict[str, Any]]:
        if "reasoning" in self._open:
            yield from self._close("reasoning", "completed")

    def _begin(self, key: object, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        index = len(self._closed) + len(self._open)
        self._open[key] = {**item, "_text": "", "_index": index}
        yield self._event("response.output_item.added", output_index=index, item=item)

    def _close_all(self, status: str) -> Iterator[dict[str, Any]]:
        """Finish the open items in output order, the last with ``status`` (completed, or
        incomplete where the reply was cut), the others completed."""
        keys = list(self._open)
        for number, key in enumerate(keys):
            yield from self._close(key, status if number == len(keys) - 1 else "completed")

    def _close(self, key: object, status: str) -> Iterator[dict[str, Any]]:
        """An open item's done events; it joins the output."""
        item = self._open.pop(key)
        text = item.pop("_text")
        index = item.pop("_index")
        if key in ("reasoning", "message"):
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if key == "reasoning":
                yield self._event("response.reasoning_text.done", **where, text=text)
                done = _reasoning_item(item["id"], text)
            else:
                if self._unsent:  # tokens after the last text (the EOS): one more delta
                    yield self._event("response.output_text.delta", **where, delta="",
                                      logprobs=self._send_unsent())  # fmt: skip
                logprobs = list(self._logprobs)
                yield self._event("response.output_text.done", **where, text=text,
                                  logprobs=logprobs)  # fmt: skip
                done = _message_item(item["id"], text, status, logprobs)
            (part,) = done["content"]
            yield self._event("response.content_part.done", **where, part=part)
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"], arguments=text)  # fmt: skip
            done = _call_item(item["id"], item["call_id"], item["name"], text, status)
        yield self._event("response.output_item.done", output_index=index, item=done)
        self._closed.append((index, done))

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event


def _failed_code(error: dict[str, Any]) -> str:
    """A failed response's ``error.code``, one of the Responses API's (its schema names
    them; a client that checks, the OpenAI SDK's ``Response.model_validate``, refused the
    chat error's "service_unavailable"): the client's request at fault is
    ``invalid_prompt``, a rate limit stays one, anything else is ``server_error``. The
    ``error`` event before it keeps the chat error's own code."""
    if error.get("code") == "rate_limit_exceeded":
        return "rate_limit_exceeded"
    return "invalid_prompt" if error.get("type") == "invalid_request_error" else "server_error"


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
