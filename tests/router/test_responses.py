"""The Responses API layer (router/responses.py, router/response_output.py) without a
stack: requests as chat requests, chat replies and chunks as responses and events. The
live tests are in test_gateway.py and test_reasoning_live.py."""

from __future__ import annotations

import pytest

from router.errors import APIError
from router.response_output import ResponseShape
from router.responses import to_chat, without_oldest_turn
from router.responses_protocol import ResponsesRequest


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


def test_instructions_and_leading_developer_items_are_one_system_message():
    """GPT-OSS's template reads only the first message as the developer's: instructions
    and a developer item after them (an agent client's sandbox rules) were two messages,
    and the second was dropped from the prompt (an audit)."""
    chat = chat_of(instructions="Be brief.", input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Read only."}]},
        {"role": "system", "content": "No rm."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Later rules stay where they are."},
    ])  # fmt: skip
    turns = [m.for_template() for m in chat.messages]
    assert turns[0] == {"role": "system", "content": "Be brief.\n\nRead only.\n\nNo rm."}
    assert [t["role"] for t in turns[1:]] == ["user", "developer"]
    alone = chat_of(input=[{"role": "developer", "content": "a"}, {"role": "user", "content": "b"}])
    assert [m.role for m in alone.messages] == ["developer", "user"]
    two = chat_of(input=[{"role": "developer", "content": "a"}, {"role": "system", "content": "b"},
                         {"role": "user", "content": "c"}])  # fmt: skip
    assert two.messages[0].for_template() == {"role": "developer", "content": "a\n\nb"}
    assert len(two.messages) == 2


def test_skip_special_tokens_is_passed_on():
    assert chat_of(input="hi").skip_special_tokens
    assert not chat_of(input="hi", skip_special_tokens=False).skip_special_tokens


def test_an_assistant_items_refusal_is_its_text():
    chat = chat_of(input=[
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "refusal", "refusal": "I can't."}]},
    ])  # fmt: skip
    assert chat.messages[1].for_template() == {"role": "assistant", "content": "I can't."}
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert "'refusal' are not supported" in refused("input", input=user_refusal)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
        ({"conversation": "conv_1"}, "conversation is not supported"),
        ({"background": True}, "background is not supported"),
        ({"max_output_tokens": 0}, "greater than or equal to 1"),
        ({"truncation": "middle"}, "'auto' or 'disabled'"),
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
                                                          "file_id": "f"}]}]}, "needs a store"),
        ("input", {"input": [{"role": "user", "content": [{"type": "input_file",
                                                          "file_id": "f"}]}]}, "text only"),
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


def test_truncation_drops_whole_turns_oldest_first():
    chat = chat_of(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "one"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "three"},
        ],
        truncation="auto",
    )
    turns = []
    while chat is not None:
        turns.append([(m.role, m.content) for m in chat.messages])
        chat = without_oldest_turn(chat)
    assert turns == [
        [("system", "Be brief."), ("user", "one"), ("assistant", None), ("tool", "x"),
         ("assistant", "done"), ("user", "two"), ("assistant", "ok"), ("user", "three")],
        [("system", "Be brief."), ("user", "two"), ("assistant", "ok"), ("user", "three")],
        [("system", "Be brief."), ("user", "three")],
    ]  # fmt: skip
    assert without_oldest_turn(chat_of(input="alone")) is None


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
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        # the message and the calls stay open to the end (text may follow a call)
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = out[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["output"][2]["name"] == "f"
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_text_after_a_call_joins_the_one_message_however_it_was_grouped():
    """Text written after a call (Hermes-style replies) became a second message, and a
    word that arrived in the call's chunk was cut over both; the whole response has one
    message with all the text. Every grouping of the same reply gives the same items."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    text = "Checking now.\n\nOne moment."
    groupings = [
        [chunk({"tool_calls": [call], "content": text})],
        [chunk({"tool_calls": [call], "content": text[:4]}), chunk({"content": text[4:]})],
        [chunk({"tool_calls": [call]}), *(chunk({"content": c}) for c in text)],
    ]
    for pieces in groupings:
        events = shape().events()
        out = list(events.start())
        for piece in [*pieces, chunk({}, finish_reason="tool_calls"), chunk(usage=USAGE)]:
            out += events.chunk(piece)
        final = out[-1]["response"]
        assert sorted(item["type"] for item in final["output"]) == ["function_call", "message"]
        (message,) = [item for item in final["output"] if item["type"] == "message"]
        assert message["content"][0]["text"] == text, pieces


def streamed(*pieces: dict, **body) -> list[dict]:
    events = shape(**body).events()
    out = list(events.start())
    for piece in pieces:
        out += events.chunk(piece)
    return out


def test_a_stream_error_fails_the_response_naming_the_responses_field():
    error = {"message": "gave up", "type": "invalid_request_error", "code": None,
             "param": "response_format"}  # what the chat path names it  # fmt: skip
    out = streamed(chunk({"content": "{"}), {"error": error},
                   text={"format": {"type": "json_object"}})  # fmt: skip
    assert [e["type"] for e in out][-2:] == ["error", "response.failed"]
    assert out[-2]["param"] == "text"
    failed = out[-1]["response"]
    assert failed["status"] == "failed" and failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "{"
    assert failed["error"]["code"] == "invalid_prompt"


def test_a_failed_responses_code_is_one_the_responses_api_names():
    """The chat error's own code ("service_unavailable") went into ``response.error``,
    whose schema names a few (the OpenAI SDK's ``Response.model_validate`` refused it);
    the ``error`` event keeps it."""
    from openai.types.responses import Response

    cases = [({"type": "service_unavailable", "code": "service_unavailable"}, "server_error"),
             ({"type": "internal_error", "code": None}, "server_error"),
             ({"type": "rate_limit_error", "code": "rate_limit_exceeded"}, "rate_limit_exceeded"),
             ({"type": "invalid_request_error", "code": "context_length_exceeded"},
              "invalid_prompt")]  # fmt: skip
    for error, code in cases:
        out = streamed(chunk({"content": "x"}), {"error": {"message": "m", **error}})
        assert out[-2]["code"] == error["code"]
        failed = out[-1]["response"]
        assert failed["error"] == {"code": code, "message": "m"}
        Response.model_validate(failed)


def test_a_cut_reply_is_incomplete_in_its_last_item_streamed_or_whole():
    """Cut while thinking: the reasoning only (no made-up empty answer), as streamed."""
    out = streamed(chunk({"reasoning_content": "hm"}), chunk({}, finish_reason="length"),
                   chunk(usage=USAGE))  # fmt: skip
    assert out[-1]["type"] == "response.incomplete"
    assert [item["type"] for item in out[-1]["response"]["output"]] == ["reasoning"]
    thinking = {"role": "assistant", "content": None, "reasoning_content": "hm"}
    whole = shape().resolved({"choices": [{"index": 0, "finish_reason": "length",
                                           "message": thinking}], "usage": USAGE})  # fmt: skip
    assert [item["type"] for item in whole["output"]] == ["reasoning"]
    out = streamed(chunk({"content": "ab"}), chunk({}, finish_reason="length"),
                   chunk(usage=USAGE))  # fmt: skip
    (message,) = out[-1]["response"]["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "ab"


def test_an_empty_reply_is_an_announced_empty_message():
    out = streamed(chunk({}, finish_reason="stop"), chunk(usage=USAGE))
    assert [e["type"] for e in out][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    (message,) = out[-1]["response"]["output"]
    assert message["status"] == "completed" and message["content"][0]["text"] == ""
    empty = {"role": "assistant", "content": ""}
    whole = shape().resolved({"choices": [{"index": 0, "finish_reason": "stop",
                                           "message": empty}], "usage": USAGE})  # fmt: skip
    assert [item["type"] for item in whole["output"]] == ["message"]


def test_what_stateless_clients_send_is_accepted_and_extensions_reach_chat():
    """The Agents SDK and Codex ask for encrypted reasoning when they keep no state; vLLM's
    extensions (Qwen3's enable_thinking, say) reach the chat request."""
    chat = chat_of(
        input="hi", include=["reasoning.encrypted_content"], top_logprobs=0, store=False,
        chat_template_kwargs={"enable_thinking": False}, include_reasoning=False, min_tokens=3,
        stop=["x"], repetition_penalty=1.2,
    )  # fmt: skip
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert (chat.include_reasoning, chat.min_tokens, chat.stop) == (False, 3, ["x"])
    assert chat.repetition_penalty == 1.2
    assert not chat.logprobs  # not asked for: top_logprobs alone shows none (OpenAI's)
    for refused_body in ({"include": ["file_search_call.results"]}, {"structural_tag": "{}"}):
        with pytest.raises(ValueError, match="not supported"):  # (not passed on to chat)
            ResponsesRequest.model_validate({"input": "hi", **refused_body})
    asked = chat_of(input="hi", include=["message.output_text.logprobs"], top_logprobs=2)
    assert (asked.logprobs, asked.top_logprobs) == (True, 2)
