"""The request schema of OpenAI's Responses API (``POST /v1/responses``), served stateless
by ``router/responses.py``. Its shared rules (``Body``) are ``router/protocol.py``'s."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from router.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    UINT32_MAX,
    VLLM_OUTPUT_FIELDS,
    Body,
    CacheSalt,
    absent,
)


class FunctionTool(Body):
    """A Responses function tool: flat, not nested in ``function`` as in chat."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningOptions(Body):
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the thinking comes whole


class TextOptions(Body):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema"}
    verbosity: Literal["medium"] | None = None  # no way to ask a model for more or less


# What a Responses ``include`` may ask for (``ResponsesRequest``).
RESPONSES_INCLUDES = {"reasoning.encrypted_content", "message.output_text.logprobs"}
# Responses fields refused unless absent (``ResponsesRequest``); vLLM's structural_tag
# too, which its chat request does not pass on.
_STATEFUL_OR_HOSTED = ("previous_response_id", "conversation", "background", "prompt",
                       "max_tool_calls", "structural_tag")  # fmt: skip


class ResponsesRequest(Body):
    """OpenAI's Responses API, stateless (``router/responses.py`` turns it into a chat
    request): what needs earlier turns kept by the server, background runs, stored
    prompt templates, and output or limits not served here are refused unless absent.
    ``include: ["reasoning.encrypted_content"]`` (what stateless clients send to get
    reasoning back) is accepted: reasoning comes back as plain text anyway.
    ``include: ["message.output_text.logprobs"]`` puts the reply's log-probs (with
    ``top_logprobs`` alternatives each) on its output text."""

    REFUSED_EXTRAS: ClassVar = {
        **dict.fromkeys(VLLM_OUTPUT_FIELDS, absent),
        **dict.fromkeys(_STATEFUL_OR_HOSTED, absent),
        "include": lambda value: not value or set(value) <= RESPONSES_INCLUDES,
        "service_tier": lambda value: value in (None, "auto", "default"),
    }

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True  # accepted; nothing is stored (responses say "store": false)
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    # "auto": a conversation past the context loses its oldest turns until it fits.
    truncation: Literal["auto", "disabled"] = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Extensions (as in chat completions), passed on to the chat request, which checks them.
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    min_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # {"enable_thinking": false}, say
    include_reasoning: bool = True
    cache_salt: CacheSalt = None
    priority: int | None = None
    skip_special_tokens: bool = True  # (vLLM's: false keeps special tokens' text)

    # The extensions handed to the chat request as they are.
    PASSED_ON: ClassVar = ("seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "logit_bias", "stop", "min_tokens",
                           "chat_template_kwargs", "include_reasoning", "cache_salt",
                           "priority", "skip_special_tokens")  # fmt: skip
