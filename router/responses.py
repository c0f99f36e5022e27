"""OpenAI's Responses API (``POST /v1/responses``) as a thin layer over chat completions.

A Responses request (``responses_protocol.ResponsesRequest``) becomes a chat request
(``chat_request``): the ``instructions`` a system message first, ``input`` items chat
turns (messages, function calls and their outputs, reasoning given back), ``text.format``
the ``response_format``, ``reasoning.effort`` the ``reasoning_effort``, flat function
tools chat tools. The chat path then does everything (templates, tools, reasoning,
structured outputs, admission, placement), and ``router/response_output.py`` reads its
reply back into Responses' items and, streamed, events.

Stateless, as vLLM serves it without a store: nothing is kept after the reply, so
``previous_response_id`` and ``conversation`` (which need the earlier turns) and
``background`` are refused with a 400 naming the field, and every response says
``"store": false``; a client sends the whole conversation as ``input`` instead. Hosted
tools (web search, file search, MCP, ...) and files are refused the same way. A user
message's ``input_image`` parts (an ``image_url``: data: or http(s)) become chat image
parts, for a vision-language model (``router/images.py``); one by ``file_id`` needs a
store and is refused. Reasoning comes whole as the item's content; ``summary`` stays empty.

``truncation: "auto"`` (OpenAI's: a conversation past the context window loses input
items) drops whole turns, oldest first (``without_oldest_turn``), keeping the system
message and the last user turn, until the prompt and ``max_output_tokens`` fit.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from router.errors import APIError, bad_request
from router.protocol import ChatCompletionRequest, FieldError
from router.responses_protocol import FunctionTool, ResponsesRequest
from router.validation_errors import describe

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
    if "message.output_text.logprobs" in (body.include or ()):
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
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
            content = item.get("content")
            if role == "user" and _has_images(content):
                message = {"role": role, "content": _parts(content, where)}
            else:
                message = {"role": role, "content": _text(content, f"{where}.content", role)}
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
                       "content": _text(item.get("output"), f"{where}.output")}  # fmt: skip
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
    return _one_leading_system(messages)


def _one_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system / developer messages the conversation starts with (``instructions``
    first), joined into one, in the first one's role: templates that read only the first
    message as the system prompt (GPT-OSS's) dropped the others, such as an agent
    client's developer item with its sandbox rules after its instructions (an audit)."""
    end = 0
    while (
        end < len(messages)
        and messages[end]["role"] in ("system", "developer")
        and isinstance(messages[end]["content"], str)
    ):
        end += 1
    if end < 2:
        return messages
    joined = "\n\n".join(message["content"] for message in messages[:end])
    return [{"role": messages[0]["role"], "content": joined}, *messages[end:]]


def without_oldest_turn(chat: ChatCompletionRequest) -> ChatCompletionRequest | None:
    """``chat`` without its oldest turn: the messages from the first one after the
    leading system / developer messages up to the next user message (an assistant's tool
    calls go with their outputs). None when only the last user turn is left."""
    messages = chat.messages
    first = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), None)
    if first is None:
        return None
    following = (i for i in range(first + 1, len(messages)) if messages[i].role == "user")
    end = next(following, None)
    if end is None:
        return None
    return chat.model_copy(update={"messages": [*messages[:first], *messages[end:]]})


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """``chat_request(body)``, its failures as 400s naming this request's fields."""
    try:
        return chat_request(body)
    except FieldError as error:
        raise bad_request(str(error), error.param) from None
    except ValidationError as error:
        # The message without its place: that is in the chat request, not in this one.
        _, message, param = describe(list(error.errors()))
        raise bad_request(message, responses_param(param)) from None


def responses_param(param: str | None) -> str | None:
    """A chat request's field as the Responses request names it (a part of a message, such
    as an image's ``messages[i].content[j].image_url``, is part of ``input``)."""
    if param is not None and param.startswith("messages["):
        return "input"
    return CHAT_TO_RESPONSES_PARAM.get(param, param) if param is not None else None


# How the chat path's messages name a field, as this request names it (by the chat
# field the error is about): a schema missing from text.format was refused as
# "response_format.json_schema.schema is required".
_MESSAGE_NAMES = {
    "response_format": (("response_format.json_schema.", "text.format."),
                        ("response_format", "text.format")),
    "max_completion_tokens": (("max_completion_tokens", "max_output_tokens"),),
    "reasoning_effort": (("reasoning_effort", "reasoning.effort"),),
}  # fmt: skip


def renamed(error: APIError) -> APIError:
    """A 400 from the chat path, naming this request's field, in the message too (and
    the input where the chat path's names the messages)."""
    for chat_name, name in _MESSAGE_NAMES.get(error.param or "", ()):
        error.message = error.message.replace(chat_name, name)
    error.param = responses_param(error.param)
    if error.code == "context_length_exceeded":
        error.message = error.message.replace("the messages", "the input")
    return error


def _required(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError(f"{where}.{key} is required (a string)", "input")
    return value


def _text(content: Any, where: str, role: str | None = None) -> str:
    """A message's (or a function output's) text: a string, or text parts (and an
    assistant's refusal parts, as OpenAI returned them: text to the template). ``where``
    names ``content`` in the request."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where} must be a string or a list of parts", "input")
    return "".join(_part_text(part, f"{where}[{index}]", role)
                   for index, part in enumerate(content))  # fmt: skip


def _part_text(part: Any, where: str, role: str | None) -> str:
    """One text part's text (or an assistant's refusal part's); ``where`` names the part."""
    kind = part.get("type") if isinstance(part, dict) else None
    key = "refusal" if kind == "refusal" and role == "assistant" else "text"
    if key == "text" and kind not in _TEXT_PARTS:
        raise FieldError(f"{where}: content parts of type {kind!r} are not supported "
                         "(text only)", "input")  # fmt: skip
    if not isinstance(part.get(key), str):
        raise FieldError(f"{where}: a part of type {kind!r} needs its {key!r} string", "input")
    return part[key]


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    )


def _parts(content: list, where: str) -> list[dict[str, Any]]:
    """A user message's text and image parts as chat content parts."""
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise FieldError(f"{where}.content[{index}]: an input_image needs its image_url "
                                 "(file_id needs a store, which this server does not keep)",
                                 "input")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            text = _part_text(part, f"{where}.content[{index}]", "user")
            parts.append({"type": "text", "text": text})
    return parts


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
