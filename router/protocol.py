"""The OpenAI request schemas the gateway accepts, validated with pydantic.

Unknown fields are ignored (clients send many). Fields we cannot honour with a non-default
value (tool_choice "auto" without a parser, legacy functions, client chat templates,
and vLLM's extensions such as logits processors or beam search) are refused with a 400
naming the field rather than silently ignored. ``null`` means the default for every field
(OpenAI documents most of them as "X or null") whose type does not admit None; one that
does keeps it (a completion's ``max_tokens: null`` is "up to the context", as in vLLM,
where leaving it out is 16). Sampling fields left unset (None) take
the checkpoint's ``generation_config.json`` defaults (see ``common.generation_config``).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from common.tokenizer import TemplateArguments

MAX_N = 128
MAX_LOGPROBS = 20
# The gRPC fields these values travel in (proto/pdserve.proto): bounds checked here give a
# 400 naming the field instead of a 500 from protobuf.
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Lists every worker goes over at every step of the request (the sampler's rules), or the
# router tokenizes: bounded, so that one request under the body limit cannot slow every
# batch it joins or stall the router (a million bad words: 31 s without a /health
# answer). The bounds are far above real use: a vocabulary for token ids (the largest
# are ~260k), a profanity list for bad words.
MAX_TOKEN_ID_LIST = 1 << 18
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 4096, 256

# A tenant's prefix-cache salt. Empty is refused (as vLLM does): it would hash as no salt
# and share every unsalted request's cached blocks, the side channel salts close.
CacheSalt = Annotated[str, StringConstraints(min_length=1)] | None


# A long list of prompts is read in the shape of its first item (texts, token ids or lists
# of token ids), a slice at a time, up to the first slice with an error. pydantic's union
# tried every shape on every item: one bad item at the end of 300,000 token-id lists gave
# 600,000 errors, 14 s of the router's event loop and 800 MB to refuse a 1.5 MB body (a
# security audit); in one shape, 300,000 bad items still gave 300,000 errors (5 s).
# Short lists keep the union, whose message names the types that would do.
_ONE_SHAPE_FROM = 64
_SHAPE_SLICE = 256
_SHAPES = {
    str: TypeAdapter(list[str]),
    int: TypeAdapter(list[StrictInt]),
    list: TypeAdapter(list[list[StrictInt]]),
}


def _one_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if not isinstance(value, list) or len(value) < _ONE_SHAPE_FROM:
        return handler(value)
    shape = _SHAPES.get(type(value[0]))  # (not a bool: its type is bool)
    if shape is None:  # the first item is wrong: the union says how, of it alone
        return handler(value[:1])
    validated = []
    for start in range(0, len(value), _SHAPE_SLICE):
        try:
            validated += shape.validate_python(value[start : start + _SHAPE_SLICE])
        except ValidationError as error:  # that slice's errors, at their places in value
            raise ValidationError.from_exception_data(error.title, [
                {"type": e["type"], "loc": (e["loc"][0] + start, *e["loc"][1:]),
                 "input": e["input"], **({"ctx": e["ctx"]} if "ctx" in e else {})}
                for e in error.errors(include_url=False)
            ]) from None  # fmt: skip
    return validated


# A completion's prompt or an embedding's input: a text, texts, token ids or lists of them.
Prompts = Annotated[
    str | list[str] | list[StrictInt] | list[list[StrictInt]], WrapValidator(_one_shape)
]


class FieldError(ValueError):
    """A request-level check's failure that names the top-level field at fault (the
    gateway's 400 carries it as ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _nullable(field: FieldInfo) -> bool:
    annotation = field.annotation
    if annotation is Any:
        return True
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(annotation)


def _lone_surrogate(value: Any) -> bool:
    """Whether ``value`` holds a string that is not valid Unicode: JSON's ``\\ud800``
    escapes decode to lone surrogates, which no tokenizer or hash can encode. Lists that
    start with an int are token ids and are not walked (their type check is pydantic's).
    A loop, not recursion: a body may nest as deep as the JSON parser allows."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list):
            if item and type(item[0]) is not int:
                pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
    return False


def absent(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, list | dict | str) and not value)


def texts_of(value: str | list) -> list[str] | None:
    """A prompt field (``prompt``, ``input``) as texts, one per prompt; None when it holds
    token ids."""
    if isinstance(value, str):
        return [value]
    return list(value) if all(isinstance(item, str) for item in value) else None


def token_lists_of(value: list) -> list[list[int]]:
    """A prompt field given as token ids: one list of ids is one prompt."""
    if all(isinstance(item, int) for item in value):
        return [list(value)]
    return [list(item) for item in value]


class Body(BaseModel):
    """What every request body shares: unknown fields ignored, ``null`` taken as the
    field's default (a field whose type admits None keeps it), strings that are not valid
    Unicode refused, floats that are not finite refused, and ``REFUSED_EXTRAS``:
    fields other servers honour and pdserve does not, refused unless ``accepts`` their
    value (by default: absent, null, false or empty)."""

    # No float field means anything at infinity or NaN (JSON has neither, but Python's
    # parser reads them): refused as not finite, not "less than or equal to 2", and never
    # passed to a worker to refuse (an unbounded repetition_penalty reached the engine).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    REFUSED_EXTRAS: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _common_checks(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if _lone_surrogate(value):
                raise FieldError(f"{key} holds text that is not valid Unicode", str(key))
            accepts = cls.REFUSED_EXTRAS.get(key)
            if accepts is not None and not accepts(value):
                raise FieldError(f"{key} is not supported by this server; leave it unset", key)
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or _nullable(fields[key])
        }


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False


# vLLM's extensions that change what is generated or returned (whitespace patterns, beam
# search, log-probs of chosen ids, ...), refused unless absent, null, false or empty.
VLLM_OUTPUT_FIELDS = (
    "guided_whitespace_pattern", "logits_processors", "use_beam_search", "prompt_embeds",
    "mm_processor_kwargs", "kv_transfer_params", "vllm_xargs", "logprob_token_ids",
)  # fmt: skip


class _SamplingFields(Body):
    REFUSED_EXTRAS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **dict.fromkeys(VLLM_OUTPUT_FIELDS, absent),
        "length_penalty": lambda value: value is None or value == 1,
    }

    model: str | None = None  # None: the served model (as vLLM)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # (vLLM: any, > 0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = None  # (only n: see ``_unsupported``)
    # vLLM's: the response's id is "chatcmpl-<it>" when plain (an X-Request-Id header
    # wins); any string is taken, as vLLM takes it, and one not plain is not used.
    request_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # (as prompt ids: not "1", true, 1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    user: str | None = None
    # Extensions (vLLM's names): per-tenant prefix-cache isolation, and the generated token
    # ids next to the text of each choice.
    cache_salt: CacheSalt = None
    return_token_ids: bool = False
    # vLLM's: log-probs name their tokens "token_id:<id>" (tokens that are no text on their
    # own, such as byte pieces, stay told apart; RL trainers read the ids back).
    return_tokens_as_token_ids: bool = False
    # vLLM's: lower values are served first, where engine.scheduling_policy is priority
    # (else it must be 0): in the router's line for a decode worker and in both engines.
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len of them), after the
    # chat template; usage and echo show what was kept. truncation_side "right" keeps the
    # first k instead ("left", the default, cuts the start).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: each prompt token's log-prob and the top n there, in the response's
    # ``prompt_logprobs`` (not streamed, as in vLLM).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's: token id (a JSON key, so a string of digits) -> bias in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be generated; and words that may not be.
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    # vLLM's detokenization options. skip_special_tokens false keeps special tokens' text
    # (not the EOS or stop token that ends the output, unless include_stop_str_in_output).
    # spaces_between_special_tokens changes nothing here: tokenizer.json (fast) tokenizers
    # join special tokens as their decoder does, as transformers' fast tokenizers and
    # vLLM's fast detokenizer do; accepted either way.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs, read by router/structured.py: OpenAI's response_format, vLLM's
    # structured_outputs object and its older guided_* fields (at most one constraint).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # one backend here (llguidance): ignored
    structural_tag: str | dict[str, Any] | None = None  # vLLM's (router/structured.py)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop cannot contain an empty string")  # (vLLM's rule)
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value  # vLLM's: -1 means unseeded

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        if value and any(not 0 <= t <= UINT32_MAX for t in value):
            raise ValueError(f"token ids must be in [0, {UINT32_MAX}]")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and len(value) > MAX_TOKEN_ID_LIST:
            raise ValueError(f"at most {MAX_TOKEN_ID_LIST} token ids")
        if value and any(not 0 <= t <= UINT32_MAX for t in value):
            raise ValueError(f"keys must be token ids in [0, {UINT32_MAX}]")
        if value and any(not -100.0 <= bias <= 100.0 for bias in value.values()):
            raise ValueError("biases must be in [-100, 100]")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("must not be empty (leave it out to allow every token)")
        if value and len(value) > MAX_TOKEN_ID_LIST:
            raise ValueError(f"at most {MAX_TOKEN_ID_LIST} token ids")
        if value and any(not 0 <= t <= UINT32_MAX for t in value):
            raise ValueError(f"token ids must be in [0, {UINT32_MAX}]")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be >= 1 (tokens kept) or -1 (max_model_len of them)")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value and len(value) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} words")
        if value and any(len(word) > MAX_BAD_WORD_CHARS for word in value):
            raise ValueError(f"words must be at most {MAX_BAD_WORD_CHARS} characters")
        if value and any(not word.strip() for word in value):
            raise ValueError("entries must contain text")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> _SamplingFields:
        # vLLM takes best_of on chat too: ignored there, a client asking best-of-3 got one
        # plain sample without a word.
        if self.best_of not in (None, self.n):
            raise FieldError("best_of is not supported (it must equal n)", "best_of")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs is not available with stream=true", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed with stream=true", "stream_options")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    REFUSED_EXTRAS = {
        **_SamplingFields.REFUSED_EXTRAS,
        "add_special_tokens": lambda value: value is None or value is True,
    }

    prompt: Prompts
    # 0 only with echo: the prompt (and its log-probs) back, nothing generated (OpenAI's).
    max_tokens: int | None = Field(default=16, ge=0, le=UINT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @property
    def prompt_texts(self) -> list[str] | None:
        """The prompts as text, one per prompt; None when they came as token ids."""
        return texts_of(self.prompt)

    @property
    def num_prompts(self) -> int:
        """How many prompts, known before any is tokenized: a text or one list of token
        ids is one; a list of texts or of token-id lists, one per entry."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return 1
        return len(prompt)

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.suffix:
            raise FieldError("suffix is not supported", "suffix")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt must not be empty", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens must be at least 1 (0 only with echo, which returns "
                             "the prompt alone)", "max_tokens")  # fmt: skip
        return self

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: score and return the prompt, generate nothing."""
        return self.echo and self.max_tokens == 0


class ImageUrl(Body):
    url: str
    detail: str | None = None  # OpenAI's "low" | "high" | "auto": every image is read whole


class ContentPart(Body):
    type: str
    text: str | None = None
    # type "image_url": OpenAI's {"url": ...}, or the URL alone (as vLLM also takes it).
    image_url: ImageUrl | str | None = None
    # type "refusal": an assistant turn's refusal, as OpenAI returned it (a replayed
    # conversation carries it); the template sees it as text, as vLLM renders it.
    refusal: str | None = None

    def template_text(self, role: str) -> str | None:
        """The text a text part (or an assistant's refusal part) stands for; None for
        other parts. Raises ValueError for a text or refusal part without its string."""
        if self.type == "refusal" and role == "assistant":
            if self.refusal is None:
                raise ValueError("a content part of type 'refusal' needs its 'refusal' string")
            return self.refusal
        if self.type != "text":
            return None
        if self.text is None:
            raise ValueError("a content part of type 'text' needs its 'text' string")
        return self.text

    @property
    def url(self) -> str | None:
        """An image part's URL (None for other parts or a part without one)."""
        if self.type != "image_url" or self.image_url is None:
            return None
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for the name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("parameters must be the JSON schema of an object (arguments)")
        return value


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(Body):
    type: Literal["function"]
    function: dict[str, Any] = Field(default_factory=dict)  # {"name": ...}

    @property
    def name(self) -> str:
        name = self.function.get("name")
        if not name or not isinstance(name, str):
            raise FieldError("tool_choice.function.name is required", "tool_choice")
        return name


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    function_call: Any = None  # OpenAI's legacy functions: refused
    # An assistant turn's thinking, as a reply gave it (either name).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def for_template(
        self, image_text: str | None = None, image_parts: bool = False
    ) -> dict[str, Any]:
        """What the chat template sees: role, text, and the author's name, tool calls
        (their arguments as objects: what Hugging Face templates render, as vLLM gives
        them), the call a tool turn answers, and an assistant turn's thinking (as
        ``reasoning_content``, Qwen3's name, and ``thinking``, GPT-OSS's), where given.

        Images (a vision-language model's, ``router/images.py``): with ``image_parts`` a
        message that has images gets its content as parts, ``{"type": "text", "text":
        ...}`` and ``{"type": "image"}``, the form vision models' templates read; with
        ``image_text``, a string with that text where each image was; else they are
        refused (ValueError)."""
        if image_parts and self.has_images:
            content: str | list[dict[str, str]] = self.parts_for_template()
        else:
            content = self.text(image_text)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        thinking = self.reasoning_content or self.reasoning
        if thinking and self.role == "assistant":
            message["reasoning_content"] = thinking
            # GPT-OSS's template refuses a call turn with both (it renders either one as
            # the analysis): there the text (a preamble) goes as before, the thinking not.
            if not (self.tool_calls and message["content"]):
                message["thinking"] = thinking
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    def text(self, image_text: str | None = None) -> str:
        """The content as text; image parts become ``image_text`` (None: refused). Text
        parts alone are joined by newlines, as vLLM joins them for a template that reads
        text ("Translate to French:" and "Good morning" ran together as one line); with
        images, the parts run on as written, as templates that read parts render them
        (so both kinds of template give one prompt the same ids)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type == "image_url" and image_text is not None:
                parts.append(image_text)
                continue
            text = part.template_text(self.role)
            if text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported")
            parts.append(text)
        return ("" if self.has_images else "\n").join(parts)

    def parts_for_template(self) -> list[dict[str, str]]:
        assert isinstance(self.content, list)
        parts = []
        for part in self.content:
            if part.type == "image_url":
                parts.append({"type": "image"})
            elif (text := part.template_text(self.role)) is not None:
                parts.append({"type": "text", "text": text})
            else:
                raise ValueError(f"content parts of type {part.type!r} are not supported")
        return parts


def _call_for_template(call: ToolCall) -> dict[str, Any]:
    text = call.function.arguments
    if not text.strip():  # (a call without arguments, as clients send it; vLLM's {})
        text = "{}"
    try:
        value = json.loads(text)
    except ValueError:
        raise FieldError(f"tool call arguments must be JSON text; got {call.function.arguments!r}",
                         "messages") from None  # fmt: skip
    arguments = TemplateArguments(value, text) if isinstance(value, dict) else value
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a reply continues the last message or starts a new one, not both."""
    if continue_final_message and add_generation_prompt:
        raise FieldError("continue_final_message needs add_generation_prompt=false",
                         "continue_final_message")  # fmt: skip


def _check_contents(messages: list[ChatMessage]) -> None:
    """Only an assistant turn may come without content (OpenAI: it may carry tool calls
    instead); a missing user, system or tool content is a client bug, not an empty turn."""
    for index, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            param = f"messages[{index}].content"
            raise FieldError(f"{param} is required for a {message.role} message", param)


class ChatCompletionRequest(_SamplingFields):
    REFUSED_EXTRAS = {
        **_SamplingFields.REFUSED_EXTRAS,
        "documents": absent,
        "add_special_tokens": lambda value: value is None or value is False,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's: the reply continues the last message (add_generation_prompt false with it)
    continue_final_message: bool = False
    # vLLM's: the last message's text, where it is an assistant message (one the reply
    # continues, with continue_final_message), goes before the reply's content.
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    include_reasoning: bool = True  # with a reasoning parser: False drops the thinking
    # How hard a reasoning model thinks; the chat template's ``reasoning_effort`` (GPT-OSS
    # writes it into its system message), overriding one in chat_template_kwargs.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # Tools: a named function or "required" constrain the output to calls
    # (router/tools.py); "auto" (the default with tools) reads them from free text with
    # the configured parser (router/tool_parsers.py) and is refused without one.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's legacy functions: refused
    function_call: Any = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.chat_template is not None:
            raise FieldError("client-supplied chat templates are not accepted", "chat_template")
        if self.functions or self.function_call not in (None, "none"):
            raise FieldError("functions are deprecated and not supported; use tools",
                             "functions" if self.functions else "function_call")  # fmt: skip
        if any(m.function_call for m in self.messages):
            raise FieldError("function_call in messages is not supported; use tool_calls",
                             "messages")  # fmt: skip
        self._check_tools()
        _check_contents(self.messages)
        _check_continuation(self.continue_final_message, self.add_generation_prompt)
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs requires logprobs=true", "top_logprobs")
        return self

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise FieldError("tool_choice needs tools", "tool_choice")
            return
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise FieldError("tools must have distinct function names", "tools")
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            raise FieldError(f"tool_choice names {choice.name!r}, which is not in tools",
                             "tool_choice")  # fmt: skip

    @property
    def calls_tools(self) -> bool:
        """Whether the output is constrained to tool calls (named or required)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables beyond the messages and tools."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # as chat's
    tools: list[Tool] | None = None  # with messages: rendered as chat would render them
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # with messages: as chat's
    return_token_strs: bool = False  # vLLM's: each token's vocabulary string too

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        _check_contents(self.messages or [])
        if self.messages is not None:
            _check_continuation(self.continue_final_message, self.add_generation_prompt)
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt]


class LoadLoraAdapterRequest(Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str  # a PEFT adapter directory, as the workers see it


class UnloadLoraAdapterRequest(Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (its ``lora_int_id`` is ignored)."""

    lora_name: str
