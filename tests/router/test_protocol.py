"""Request schemas: null means the default, what cannot be honoured is refused by name, and
text that is not valid Unicode never reaches the tokenizer."""

from __future__ import annotations

import pydantic
import pytest

from router.protocol import ChatCompletionRequest, CompletionRequest, FieldError, TokenizeRequest


def refused_param(model: type[pydantic.BaseModel], body: dict) -> str | None:
    """The field a refused body is blamed on (what the gateway's 400 names)."""
    with pytest.raises(pydantic.ValidationError) as refused:
        model.model_validate(body)
    error = refused.value.errors()[0]
    loc = error["loc"]
    if loc:
        return str(loc[0])
    cause = error.get("ctx", {}).get("error")
    return cause.param if isinstance(cause, FieldError) else None


def test_null_means_the_default():
    """OpenAI documents these as "X or null"; SDKs and proxies send null for unset."""
    names = ("n", "stream", "echo", "ignore_eos", "min_tokens", "skip_special_tokens",
             "return_token_ids", "stream_options")  # fmt: skip
    nulls = dict.fromkeys(names)
    completion = CompletionRequest.model_validate({"prompt": "x", **nulls})
    assert (completion.n, completion.stream, completion.min_tokens) == (1, False, 0)
    assert completion.skip_special_tokens and not completion.return_token_ids
    # A nullable field keeps its null: max_tokens null means "up to the context", as in vLLM.
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None
    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi", "name": None}],
        "logprobs": None, "stream": True, "stream_options": {"include_usage": None},
        "add_generation_prompt": None,
    })  # fmt: skip
    assert (chat.logprobs, chat.include_usage, chat.add_generation_prompt) == (False, False, True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_whitespace_pattern", r"\s*"),
        ("prompt_logprobs", -1),  # vLLM's whole vocabulary
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
        ("use_beam_search", True),
        ("priority", 2**31),  # an int32 on the wire
        ("priority", 1.5),
        ("add_special_tokens", False),
        ("best_of", 3),
        ("stream_options", {"include_usage": True}),  # without stream
        ("truncation_side", "middle"),
        ("logprob_token_ids", [5]),
        ("stop", [""]),  # vLLM's rule: it would match everywhere
        ("stop", ""),
    ],
)
def test_completion_fields_that_change_the_output_are_refused_by_name(field, value):
    assert refused_param(CompletionRequest, {"prompt": "x", field: value}) == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"x": 1.0}),  # keys are token ids
        ("logit_bias", {"-3": 1.0}),
        ("logit_bias", {"5": 101}),  # OpenAI's range: [-100, 100]
        ("logit_bias", {"5": "NaN"}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("bad_words", ["ok", " "]),
    ],
)
def test_bad_logit_bias_and_allowed_token_ids_are_refused_by_name(field, value):
    assert refused_param(CompletionRequest, {"prompt": "x", field: value}) == field
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    assert refused_param(ChatCompletionRequest, body) == field


def test_vllms_value_conventions():
    """A seed of -1 is no seed, and any finite repetition_penalty above 0 passes, as in
    vLLM."""
    assert CompletionRequest.model_validate({"prompt": "x", "seed": -1}).seed is None
    assert CompletionRequest.model_validate({"prompt": "x", "seed": -2}).seed == -2
    body = {"prompt": "x", "repetition_penalty": 20}
    assert CompletionRequest.model_validate(body).repetition_penalty == 20
    assert refused_param(CompletionRequest, {"prompt": "x", "repetition_penalty": 0}) == (
        "repetition_penalty"
    )


def test_logit_bias_keys_are_token_ids():
    body = CompletionRequest.model_validate(
        {"prompt": "x", "logit_bias": {"5": -100, "17": 2.5}, "allowed_token_ids": [5, 9]}
    )
    assert body.logit_bias == {5: -100.0, 17: 2.5} and body.allowed_token_ids == [5, 9]


def test_their_default_values_pass():
    defaults = {"guided_whitespace_pattern": None, "structural_tag": "", "priority": 0,
                "length_penalty": 1.0, "use_beam_search": False, "prompt_logprobs": None,
                "add_special_tokens": True, "response_format": {"type": "text"},
                "logit_bias": {}}  # fmt: skip
    CompletionRequest.model_validate({"prompt": "x", **defaults})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logits_processors", ["x"]),
        (
            "tools",
            [
                {
                    "type": "function",  # arguments are an object
                    "function": {"name": "f", "parameters": {"type": "string"}},
                }
            ],
        ),
        ("tool_choice", {"type": "function"}),  # no name
        ("continue_final_message", True),
        ("add_special_tokens", True),
        ("tools", [{"type": "function"}]),
        ("tool_choice", "required"),
        ("top_logprobs", 2),  # without logprobs
        ("best_of", 3),  # (ignored, one plain sample came back for best-of-3)
    ],
)
def test_chat_fields_that_change_the_output_are_refused_by_name(field, value):
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    assert refused_param(ChatCompletionRequest, body) == field


def test_lone_surrogates_are_refused_where_they_stand():
    """JSON's \\ud800 escapes decode to strings no tokenizer or hash can encode."""
    bad = "a\ud800b"
    assert refused_param(CompletionRequest, {"prompt": bad}) == "prompt"
    assert refused_param(CompletionRequest, {"prompt": ["ok", bad]}) == "prompt"
    assert refused_param(CompletionRequest, {"prompt": "x", "cache_salt": bad}) == "cache_salt"
    assert refused_param(CompletionRequest, {"prompt": "x", "stop": [bad]}) == "stop"
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": bad}]}]}
    assert refused_param(ChatCompletionRequest, chat) == "messages"
    # Token ids are not walked, and valid non-ASCII text passes.
    CompletionRequest.model_validate({"prompt": list(range(50_000))})
    CompletionRequest.model_validate({"prompt": "naïve 東京 🙂"})


def test_a_message_author_name_reaches_the_template():
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi", "name": "ana"},
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert [m.for_template() for m in chat.messages] == [
        {"role": "user", "content": "hi", "name": "ana"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("field", ["repetition_penalty", "temperature", "top_p"])
def test_floats_that_are_not_finite_are_refused_as_such(field, value):
    """Python's JSON reads Infinity, NaN and 1e400; an infinite repetition_penalty
    passed (a worker refused it, counted as a failed request) and NaN was "not less
    than or equal to 2"."""
    with pytest.raises(pydantic.ValidationError, match="finite number") as refused:
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert refused.value.errors()[0]["loc"] == (field,)


def test_an_assistant_turns_refusal_reaches_the_template_as_its_text():
    """OpenAI's replies may carry a refusal part; a client replaying the conversation
    sends it back (it was a 400)."""
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}, refusal]}
    )
    assert chat.messages[1].for_template() == {"role": "assistant", "content": "I can't."}
    assert chat.messages[1].parts_for_template() == [{"type": "text", "text": "I can't."}]
    for message in ({**refusal, "role": "user"},  # only an assistant refuses
                    {"role": "assistant", "content": [{"type": "refusal"}]}):  # fmt: skip
        chat = ChatCompletionRequest.model_validate({"messages": [message]})
        with pytest.raises(ValueError, match="refusal"):
            chat.messages[0].for_template()


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_only_an_assistant_message_may_come_without_content(role):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None}]
    assert refused_param(ChatCompletionRequest, {"messages": messages}) == "messages[1].content"
    assert refused_param(TokenizeRequest, {"messages": [{"role": role}]}) == "messages[0].content"


def test_prompt_logprobs_are_not_streamed():
    """As in vLLM: they come whole, in the response body."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, chat)):
        assert model.model_validate({**body, "prompt_logprobs": 2}).prompt_logprobs == 2
        streamed = {**body, "prompt_logprobs": 2, "stream": True}
        assert refused_param(model, streamed) == "prompt_logprobs"


def test_tool_calls_reach_the_template_with_their_arguments_as_objects():
    """OpenAI sends a call's arguments as JSON text; Hugging Face templates render them
    as objects (vLLM converts them the same way)."""
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]})  # fmt: skip
    assistant, tool = (m.for_template() for m in body.messages[1:])
    function = {"name": "f", "arguments": {"a": [1, 2]}}
    assert assistant["tool_calls"] == [{"id": "c1", "type": "function", "function": function}]
    assert tool == {"role": "tool", "content": "done", "tool_call_id": "c1"}


def test_an_assistant_turns_thinking_reaches_the_template_under_both_names():
    """Qwen3's templates read ``reasoning_content``, GPT-OSS's ``thinking``; a reply's
    ``reasoning`` (vLLM's newer name) is taken too. Only an assistant turn thinks."""
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "x", "reasoning_content": "not mine"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"},
        {"role": "assistant", "content": "5", "reasoning": "2 + 3"}]})  # fmt: skip
    user, first, second = (m.for_template() for m in body.messages)
    assert user == {"role": "user", "content": "x"}
    assert first == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2",
                     "thinking": "2 + 2"}  # fmt: skip
    assert second["reasoning_content"] == second["thinking"] == "2 + 3"
    # A call turn with text and thinking (a GPT-OSS reply sent back as it came): GPT-OSS's
    # template refuses both, and renders the text as the analysis, as before thinking went.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "r",
         "tool_calls": [call]}]})  # fmt: skip
    turn = body.messages[1].for_template()
    assert turn["reasoning_content"] == "r" and "thinking" not in turn


def test_reasoning_effort_is_a_template_variable():
    messages = [{"role": "user", "content": "x"}]
    body = ChatCompletionRequest.model_validate({"messages": messages})
    assert body.template_kwargs is None
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "reasoning_effort": "high",
         "chat_template_kwargs": {"reasoning_effort": "low", "other": 1}})  # fmt: skip
    assert body.template_kwargs == {"reasoning_effort": "high", "other": 1}
    extreme = {"messages": messages, "reasoning_effort": "extreme"}
    assert refused_param(ChatCompletionRequest, extreme) == "reasoning_effort"
