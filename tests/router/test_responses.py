"""The Responses API layer (router/responses.py) without a stack: requests as chat
requests, chat replies and chunks as responses and events. The live tests are in
test_gateway.py and test_reasoning_live.py."""

from __future__ import annotations

import pytest

from router.errors import APIError
from router.protocol import ResponsesRequest
from router.responses import ResponseShape, to_chat


def chat_of(**body):
    return to_chat(ResponsesRequest.model_validate(body))


def refused(param: str, **body) -> str:
    with pytest.raises(APIError) as error:
        chat_of(**body)
    assert (error.value.status, error.value.param) == (400, param)
    return str(error.value)


def test_instructions_and_items_become_chat_turns():
    chat = chat_of(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "And "},
                                         {"type": "input_text", "text": "Rome?"}]},
        ],
        max_output_tokens=7,
        reasoning={"effort": "low"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        tools=[{"type": "function", "name": "weather", "parameters": {"type": "object"}},
               {"type": "function", "name": "time"}],
        tool_choice={"type": "function", "name": "weather"},
    )  # fmt: skip
    turns = [m.for_template() for m in chat.messages]
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "assistant",
                                          "user"]  # fmt: skip
    assert turns[0]["content"] == "Be brief." and turns[5]["content"] == "And Rome?"
    calls = turns[2]["tool_calls"]  # both calls of one turn, after its reasoning
    assert [c["id"] for c in calls] == ["c1", "c2"] and turns[2]["reasoning_content"] == (
        "Use the tool."
    )
    assert turns[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert chat.max_completion_tokens == 7 and chat.reasoning_effort == "low"
    schema = {"name": "w", "schema": {"type": "object"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": schema}
    assert chat.tool_choice.name == "weather" and chat.tools[1].function.name == "time"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
        ({"conversation": "conv_1"}, "conversation is not supported"),
        ({"background": True}, "background is not supported"),
        ({"max_output_tokens": 0}, "greater than or equal to 1"),
    ],
)
def test_state_and_bounds_are_refused_with_the_request(body, message):
    """Stateless: nothing earlier can be referred to (the gateway's 400 names the field)."""
    with pytest.raises(ValueError, match=message):
        ResponsesRequest.model_validate({"input": "hi", **body})


@pytest.mark.parametrize(
    ("param", "body", "message"),
    [
        ("input", {"input": [{"role": "user", "content": [{"type": "input_image",
                                                          "image_url": "x"}]}]}, "text only"),
        ("input", {"input": [{"type": "web_search_call"}]}, "not supported"),
        ("input", {"input": [{"type": "function_call", "name": "f"}]}, "call_id is required"),
        ("input", {"input": []}, "at least one message"),
        ("tools", {"tools": [{"type": "web_search"}]}, "function only"),
        ("tool_choice", {"tools": [{"type": "function", "name": "f"}],
                         "tool_choice": {"type": "web_search"}}, "tool_choice must be"),
        ("tool_choice", {"tool_choice": "required"}, "needs tools"),  # the chat check's
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(param, body, message):
    assert message in refused(param, **{"input": "hi", **body})


def shape(**body) -> ResponseShape:
    return ResponseShape(ResponsesRequest.model_validate({"input": "hi", **body}), "m")


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
         "prompt_tokens_details": {"cached_tokens": 2},
         "completion_tokens_details": {"reasoning_tokens": 1}}  # fmt: skip


def test_a_whole_reply_becomes_reasoning_message_and_calls():
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "ok", "reasoning_content": "hm", "tool_calls": [call]}}],
        "usage": USAGE}  # fmt: skip
    response = shape().resolved(chat)
    assert [item["type"] for item in response["output"]] == ["reasoning", "message",
                                                              "function_call"]  # fmt: skip
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert response["output"][1]["content"][0]["text"] == "ok"
    assert response["output"][2]["call_id"] == "call_9"
    assert response["status"] == "completed" and response["store"] is False
    assert response["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 8,
    }  # fmt: skip
    message = {"role": "assistant", "content": "a"}
    length = {"choices": [{"index": 0, "finish_reason": "length", "message": message}],
              "usage": USAGE}  # fmt: skip
    cut = shape().resolved(length)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def chunk(delta=None, finish_reason=None, usage=None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta,
                                         "finish_reason": finish_reason}]  # fmt: skip
    return {"choices": choices, **({"usage": usage} if usage else {})}


def test_streamed_chunks_become_ordered_events():
    events = shape().events()
    out = list(events.start())
    for piece in (
        chunk({"role": "assistant", "reasoning_content": "th"}),
        chunk({"reasoning_content": "ink"}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": "{\"a\""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({}, finish_reason="tool_calls"),
        chunk(usage=USAGE),
    ):  # fmt: skip
        out += events.chunk(piece)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = out[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["output"][2]["name"] == "f"
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_a_stream_error_fails_the_response_and_a_cut_one_is_incomplete():
    events = shape().events()
    list(events.start())
    error = {"message": "boom", "type": "server_error", "code": None}
    out = [*events.chunk(chunk({"content": "a"})), *events.chunk({"error": error})]
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    assert out[-1]["response"]["status"] == "failed"
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "a"
    events = shape().events()
    list(events.start())
    out = [*events.chunk(chunk({}, finish_reason="length")), *events.chunk(chunk(usage=USAGE))]
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["output"][0]["type"] == "message"  # an empty answer
