"""The generating routes: ``/v1/completions``, ``/v1/chat/completions`` and, over the
chat path, ``/v1/responses``. Routes translate HTTP to choices and choices back to JSON
or SSE; placement and transport live in ``dispatch.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from common.detokenizer import IncrementalDetokenizer
from common.structured_output import STRUCTURED_OUTPUT, StructuredOutput
from common.tokenizer import Tokenizer
from common.tracing import NO_SPAN, Span
from proto import pdserve_pb2 as pb
from router.admission import (
    GONE,
    REQUEST_ID,
    RESPONSE_SHAPE,
    Admission,
    client_request_id,
    plain_request_id,
    record_error,
    stopped,
    until_disconnected,
)
from router.choices import Choice, build_choices, hashing, merge_choices, new_id
from router.errors import APIError, bad_request, internal
from router.formatting import SSE_DONE, Formatter, ToolFormat, json_bytes, sse, usage_body
from router.harmony import Harmony, call_constraint
from router.harmony import opening_of as harmony_opening
from router.images import PromptImages, image_counts, image_refs, place_images, read_images
from router.json_body import Body
from router.media_fetch import MediaFetcher
from router.prompts import PromptTokenizer, tool_dicts
from router.protocol import ChatCompletionRequest, CompletionRequest, FieldError, NamedToolChoice
from router.reasoning import PROMPT_TAIL_TOKENS, Reasoning, opening_of
from router.response_output import ResponseShape, translate_stream
from router.responses import renamed, to_chat, without_oldest_turn
from router.responses_protocol import ResponsesRequest
from router.state import RouterState
from router.structured import check as check_constraint
from router.structured import structured_output_of
from router.tool_parsers import tool_format_of
from router.tools import ToolCalls, call_schemas
from router.workers import LoraRef

logger = logging.getLogger(__name__)


async def _blaming(events: AsyncIterator, param: str) -> AsyncIterator:
    """``events``, with a worker's refusal of the output constraint (its param
    ``structured_output``: llguidance gave up on it mid-generation) naming the field the
    client gave it in (``guided_regex``, ``tools``, ...)."""
    try:
        async for event in events:
            yield event
    except APIError as error:
        if error.param == STRUCTURED_OUTPUT:
            error.param = param
        raise
    finally:
        await events.aclose()  # closing this closes the choices at once


@dataclass
class _StreamEnd:
    """Whether a stream's body got to its end (``[DONE]`` written): one that did not was
    left by its client, however the leaving showed (a failed write, a cancelled task,
    a body that never started)."""

    reached: bool = False


class _AdmittedStream(StreamingResponse):
    """A streamed response that, however it ends, gives its admission back and closes the
    choices' event stream (which aborts sequences still running): also when the client
    left before the first byte, when the body's generator never starts and its own
    ``finally`` would never run. A stream that did not reach its ``end`` marks ``span``
    cancelled before the release ends it."""

    def __init__(self, content: AsyncIterator[bytes], events: AsyncGenerator,
                 release: Callable[[], None], span: Span, end: _StreamEnd,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(content, **kwargs)
        self._events = events
        self._release = release
        self._span = span
        self._end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._end.reached:
                self._span.set({"pdserve.cancelled": True})
            self._release()
            with anyio.CancelScope(shield=True):  # runs even when the client's gone
                await self._events.aclose()


def ended(span: Span, release: Callable[[], None], choices: list[Choice]) -> Callable[[], None]:
    """``release``, which also ends ``span``, with the request's token counts: every path
    that ends a request that ran (done, failed, the client gone) releases it once."""
    if span is NO_SPAN:
        return release

    def end() -> None:
        release()
        usage = usage_body(choices)
        span.set({
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "pdserve.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "pdserve.finish_reasons": ",".join(c.finish_reason or "" for c in choices),
        })  # fmt: skip
        span.end()

    return end


def check_num_sequences(num_sequences: int, n: int, limit: int) -> None:
    """A request's sequences (prompts x n) must fit the router's limit at once."""
    if num_sequences > limit:
        raise bad_request(
            f"the request asks for {num_sequences} sequences (prompts x n); this server "
            f"runs at most {limit} at once",
            "n" if n > 1 else "prompt",
        )


def _check_token_ids(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """Token ids of the body in the model's vocabulary (what the engine checks too)."""
    for name, token_ids in (("stop_token_ids", body.stop_token_ids),
                            ("logit_bias", body.logit_bias),
                            ("allowed_token_ids", body.allowed_token_ids)):  # fmt: skip
        if any(t >= vocab_size for t in token_ids or ()):
            raise bad_request(f"{name} must be in [0, {vocab_size}) (token ids)", name)


async def _output_constraint(
    state: RouterState,
    body: CompletionRequest | ChatCompletionRequest,
    calls_format: ToolFormat | Harmony | None,
    thinks: Reasoning | Harmony | None,
) -> tuple[str, StructuredOutput] | None:
    """What constrains the output, and the parameter that asked for it: the body's
    structured output, or the tool calls ``calls_format`` forces (never both), applied
    after any thinking; compiled once here so that a bad one is a 400 before admission.
    ``calls_format``: what may constrain the output to calls; ``thinks``: what tells
    this reply's thinking apart."""
    try:
        constraint = structured_output_of(body)
        if calls_format is not None and calls_format.structured is not None:
            if constraint is not None:  # the calls are the output's constraint
                raise FieldError(f"{constraint[0]} cannot be combined with tool_choice "
                                 "required or a named function", constraint[0])  # fmt: skip
            constraint = ("tools", calls_format.structured)
        if constraint is not None and thinks is not None:  # it applies after thinking
            constraint = (constraint[0], thinks.constrained(constraint[1]))
        if constraint is not None:  # a large schema compiles for a while: off the loop
            # On threads of their own: on the shared pool, 12 slow compiles held every
            # request's tokenizing (a plain completion waited 11.7 s).
            await asyncio.get_running_loop().run_in_executor(
                state.compile_pool, check_constraint, state.grammar_compiler, *constraint
            )
    except FieldError as error:
        raise bad_request(str(error), error.param) from None
    return constraint


def _echo_texts(
    body: CompletionRequest, prompts: list[list[int]], tokenizer: Tokenizer
) -> list[str]:
    """What ``echo`` repeats of each prompt: the text sent, or token ids decoded (and
    what truncation kept of them)."""
    texts = body.prompt_texts
    if texts is not None and body.truncate_prompt_tokens is None:
        return texts
    return [tokenizer.decode(tokens, skip_special_tokens=False) for tokens in prompts]


def _continued_message(body: ChatCompletionRequest) -> list[str] | None:
    """What a chat's ``echo`` repeats: the assistant message the reply continues (an
    image in it has no text to repeat; a content of null stays null)."""
    if body.messages[-1].role != "assistant":
        return None
    continued = body.messages[-1].text(image_text="")
    return [continued] if continued else None


async def _sampling(
    state: RouterState,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    chat: bool,
    logprobs: int | None,
    structured: StructuredOutput | None,
) -> tuple[pb.SamplingParams, list[str] | None]:
    """The request's sampling parameters as the workers take them, and what ``echo``
    repeats (None: nothing). The prompt is scored once, with the larger top n of
    ``prompt_logprobs`` and an echo's ``logprobs``; each use cuts its own. ``echo_only``
    computes one token (with the prompt's scores), which is not shown."""
    if body.bad_words:  # tokenized (up to MAX_BAD_WORDS of them): off the event loop
        sampling = await asyncio.to_thread(state.sampling_params, body, logprobs, chat,
                                           structured)  # fmt: skip
    else:
        sampling = state.sampling_params(body, logprobs, chat, structured)
    echo = None
    scored = [] if body.prompt_logprobs is None else [body.prompt_logprobs]
    if not chat and body.echo:
        echo = await asyncio.to_thread(_echo_texts, body, prompts, state.tokenizer)
        if logprobs is not None:  # the prompt's log-probs come first
            scored.append(logprobs)
    elif chat and body.echo:
        echo = _continued_message(body)
    if scored:
        sampling.prompt_logprobs = max(scored)
    if sampling.HasField("max_tokens") and sampling.min_tokens > sampling.max_tokens:
        raise bad_request(f"min_tokens must be <= max_tokens={sampling.max_tokens}, got "
                          f"{sampling.min_tokens}", "min_tokens")  # fmt: skip
    if not chat and body.echo_only:
        sampling.max_tokens = 1
    return sampling, echo


def _choice_builder(
    state: RouterState,
    body: CompletionRequest | ChatCompletionRequest,
    choice_id: str,
    prompts: list[list[int]],
    sampling: pb.SamplingParams,
    chat: bool,
    keep_special: frozenset[int],
    lora: LoraRef | None,
    images: PromptImages | None,
    echo_only: bool,
) -> Callable[[], list[Choice]]:
    """``build_choices`` for this request's ``prompts``, to call later (``choices.hashing``
    calls it, off the event loop for long prompts); each choice's detokenizer keeps
    ``keep_special`` (markers a parser reads)."""

    def detokenizer(stop: list[str], prompt: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(state.tokenizer, stop, body.min_tokens, keep_special,
                                      body.include_stop_str_in_output,
                                      body.skip_special_tokens, context=prompt)  # fmt: skip

    return functools.partial(
        build_choices, choice_id, prompts, n=body.n, sampling=sampling, stop=body.stop_strings,
        max_model_len=state.model.max_model_len, block_size=state.model.block_size,
        detokenizer_factory=detokenizer, cache_salt=body.cache_salt, lora=lora,
        prompt_param="messages" if chat else "prompt", priority=body.priority,
        echo_only=echo_only, eos_token_ids=state.model.eos_token_ids, images=images,
        main_eos_id=state.tokenizer.eos_token_id,
        default_max_tokens=state.generation_defaults.max_tokens,
    )  # fmt: skip


async def _whole_reply(
    formatter: Formatter, choices: list[Choice], shape: ResponseShape | None
) -> Response:
    """A reply without streaming, as chat's object or (``/v1/responses``) ``shape``'s.
    With the prompt's scores, built off the loop and encoded by msgspec a slice at a
    time: a 100k-token prompt's top 20 held it 5.4 s (json.dumps is one C call holding
    the GIL)."""

    def whole() -> bytes:
        reply = formatter.final(choices)
        return json_bytes(reply if shape is None else shape.resolved(reply),
                          sliced=formatter.scores_tokens)  # fmt: skip

    body = await asyncio.to_thread(whole) if formatter.scores_tokens else whole()
    return Response(body, media_type="application/json")


def add_generation_routes(
    app: FastAPI, state: RouterState, prompt_tokenizer: PromptTokenizer, admission: Admission
) -> None:
    media = MediaFetcher(state.config.router.allowed_media_domains,
                         state.config.router.media_fetch_timeout_s)  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: Body[CompletionRequest], request: Request) -> Response:
        lora_name = admission.lora_name(body.model)
        # Before tokenizing: a million prompts took 13 s of the router's work to refuse.
        limit = state.config.router.max_inflight_sequences
        check_num_sequences(body.num_prompts * body.n, body.n, limit)
        # Tokenizing a long prompt takes a while: off the event loop, so that other
        # requests' streams keep flowing meanwhile.
        prompts = await asyncio.to_thread(prompt_tokenizer.completion, body)
        return await respond(
            request, body, prompts, chat=False, logprobs=body.logprobs, lora_name=lora_name
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: Body[ChatCompletionRequest], request: Request) -> Response:
        lora_name = admission.lora_name(body.model)
        # A Harmony reply (GPT-OSS) is read by the one format, its tool calls included.
        harmony = state.harmony_ids is not None
        try:
            parser = state.config.router.tool_call_parser
            tool_format = None
            if body.tools and not harmony:  # (a constraint of every schema: off the loop)
                tool_format = await asyncio.to_thread(tool_format_of, body, parser)
        except FieldError as error:
            raise bad_request(str(error), error.param) from None
        # Watched: fetching the images of a client that left went on (a slow host, 20 s).
        prepared = await until_disconnected(request, chat_prompt(body), stopping)
        if prepared is GONE:
            return Response(status_code=499)
        prompt, images = prepared
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tail = state.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        if harmony:
            calls = bool(body.tools) and body.tool_choice != "none"
            forced = None  # "required" or a named function: a grammar makes the call
            if body.calls_tools:
                forced = await asyncio.to_thread(harmony_calls, body)
            named = isinstance(body.tool_choice, NamedToolChoice)
            reader = Harmony(harmony_opening(tail, calls), calls, body.include_reasoning,
                             forced, named)  # fmt: skip
            return await respond(request, body, [prompt], chat=True, logprobs=logprobs,
                                 harmony=reader, lora_name=lora_name,
                                 keep_special=state.harmony_ids, images=images)  # fmt: skip
        # A parser whose markers are special tokens reads them in the text (state.py).
        parsed = tool_format is not None and not isinstance(tool_format, ToolCalls)
        keep = state.tool_marker_ids if parsed else frozenset()
        return await respond(request, body, [prompt], chat=True, logprobs=logprobs,
                             tool_format=tool_format, reasoning=reasoning_of(body, tail),
                             lora_name=lora_name, keep_special=keep, images=images)  # fmt: skip

    def stopping() -> bool:
        return state.stopping

    def harmony_calls(body: ChatCompletionRequest) -> StructuredOutput:
        return call_constraint(call_schemas(body), state.tokenizer)

    async def chat_prompt(body: ChatCompletionRequest) -> tuple[list[int], PromptImages | None]:
        """The messages through the chat template as ids (tokenized off the event loop),
        and their images placed (``router/images.py``)."""
        vision = state.model.vision
        router = state.config.router
        refs = image_refs(body.messages, state.image_text, router.max_images_per_request)
        if refs and body.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images",
                              "truncate_prompt_tokens")  # fmt: skip
        images = await read_images(refs, media, router.max_request_bytes) if refs else []
        args = (
            body.messages, body.add_generation_prompt, tool_dicts(body.tools),
            body.template_kwargs, body.continue_final_message, prompt_tokenizer.limit(body),
            prompt_tokenizer.window(body),
        )  # fmt: skip
        if not images:
            return await asyncio.to_thread(prompt_tokenizer.chat, *args), None
        assert vision is not None and state.image_text is not None

        def with_images() -> tuple[list[int], PromptImages]:
            # (On a thread: the images' headers read, their sha256s: 50 ms for 24 MB.)
            counts = image_counts(images, vision)
            prompt = prompt_tokenizer.chat_images(counts, *args)
            return place_images(prompt, images, vision, counts)

        return await asyncio.to_thread(with_images)

    @app.post("/v1/responses")
    async def responses(body: Body[ResponsesRequest], request: Request) -> Response:
        """OpenAI's Responses API, stateless, over the chat path (``router/responses.py``)."""
        chat = await asyncio.to_thread(to_chat, body)  # (a validation as long as the body's)
        shape = ResponseShape(body, body.model or state.model.served_name)
        request.scope[RESPONSE_SHAPE] = shape  # a whole reply is built as this object
        while True:
            try:
                reply = await chat_completions(chat, request)
                break
            except APIError as error:
                shorter = None
                if body.truncation == "auto" and error.code == "context_length_exceeded":
                    shorter = without_oldest_turn(chat)  # it failed before anything ran
                if shorter is None:
                    raise renamed(error) from None
                chat = shorter
        if reply.status_code != 200:  # the client left
            return reply
        if isinstance(reply, StreamingResponse):
            reply.body_iterator = translate_stream(shape, reply.body_iterator)
        return reply

    def reasoning_of(body: ChatCompletionRequest, tail: str) -> Reasoning | None:
        """How this reply's thinking is told apart (None: no reasoning parser).
        ``tail``: the prompt's end, special tokens kept."""
        continued = None
        if body.continue_final_message:  # (as text parts too: the template joins them)
            continued = body.messages[-1].text(image_text="")
        opening = opening_of(state.config.router.reasoning_parser, tail, continued)
        return None if opening is None else Reasoning(opening, body.include_reasoning)

    async def respond(
        request: Request,
        body,
        prompts: list[list[int]],
        chat: bool,
        logprobs: int | None,
        tool_format: ToolFormat | None = None,
        reasoning: Reasoning | None = None,
        lora_name: str | None = None,
        harmony: Harmony | None = None,
        keep_special: frozenset[int] | None = frozenset(),
        images: PromptImages | None = None,
    ):
        """``lora_name``: the adapter the request's ``model`` named; None: the base model.
        ``keep_special``: special tokens kept in the text (markers a parser reads)."""
        admission.check_open()
        _check_token_ids(body, state.model.vocab_size or state.tokenizer.vocab_size)
        window = prompt_tokenizer.window(body)
        if window is not None:
            prompts = [window.ids(prompt) for prompt in prompts]
        admission.check_priority(body.priority)
        num_sequences = len(prompts) * body.n
        check_num_sequences(num_sequences, body.n, state.config.router.max_inflight_sequences)
        constraint = await _output_constraint(state, body, tool_format or harmony,
                                               reasoning or harmony)  # fmt: skip
        structured = constraint[1] if constraint is not None else None
        sampling, echo = await _sampling(state, body, prompts, chat, logprobs, structured)
        echo_only = not chat and body.echo_only
        if await request.is_disconnected():  # it left while its prompt was tokenized
            return Response(status_code=499)
        # The client's id where it gave one, as vLLM (its header, else its body's
        # request_id): the response is "chatcmpl-<id>". The workers' sequence ids stay
        # unique whatever a client sends again (a retry under its id).
        prefix = "chatcmpl" if chat else "cmpl"
        client_id = client_request_id(request.scope) or plain_request_id(body.request_id)
        response_id = new_id(prefix) if client_id is None else f"{prefix}-{client_id}"
        request.scope[REQUEST_ID] = response_id  # its X-Request-Id (``router/app.py``)
        choice_id = response_id if client_id is None else new_id(response_id)
        lora = state.adapters.resolve(lora_name) if lora_name is not None else None
        build = _choice_builder(state, body, choice_id, prompts, sampling, chat,
                                keep_special or frozenset(), lora, images, echo_only)  # fmt: skip
        choices = await hashing(prompts, build)
        formatter = Formatter(
            response_id, lora_name or state.model.served_name, chat, logprobs,
            state.token_text, body.return_token_ids, echo, body.prompt_logprobs, tool_format,
            reasoning, harmony, body.return_tokens_as_token_ids,
            parallel_tool_calls=not chat or body.parallel_tool_calls,
            token_bytes=state.token_bytes,
        )  # fmt: skip
        release = admission.admit(num_sequences, lora_name)  # no await since: nothing else got in
        span = admission.span(request, response_id, lora_name, num_sequences)
        if span.headers:  # every worker call of the request carries its trace context
            for choice in choices:
                choice.request = dataclasses.replace(choice.request, trace_headers=span.headers)
        release = ended(span, release, choices)
        arrival = time.perf_counter()
        events = merge_choices(state.dispatcher, choices, state.metrics, arrival)
        if constraint is not None:
            events = _blaming(events, constraint[0])

        async def collect() -> None:
            async for _ in events:
                if state.stopping:
                    raise stopped()

        # A stream's headers wait for its first event, so that what fails before anything
        # was generated (no worker, a worker refusing the input) is an HTTP status, as
        # without streaming, and not a 200 with an error event.
        work = anext(events, None) if body.stream else collect()
        try:
            first = await until_disconnected(request, work, stopping)
        except BaseException as exc:
            record_error(span, exc)
            release()
            await events.aclose()
            if isinstance(exc, APIError) or not isinstance(exc, Exception):
                raise
            logger.exception("request %s failed", response_id)
            raise internal(response_id) from None
        if first is GONE:
            span.set({"pdserve.cancelled": True})
            release()
            await events.aclose()
            return Response(status_code=499)  # nobody is listening; the work is aborted
        if body.stream:
            end = _StreamEnd()
            return _AdmittedStream(
                stream(
                    formatter,
                    choices,
                    first,
                    events,
                    body.include_usage,
                    body.continuous_usage,
                    span,
                    end,
                ),
                events,
                release,
                span,
                end,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        release()
        return await _whole_reply(formatter, choices, request.scope.get(RESPONSE_SHAPE))

    async def stream(
        formatter: Formatter,
        choices,
        first,
        events: AsyncIterator,
        include_usage: bool,
        continuous_usage: bool,
        span: Span,
        end: _StreamEnd,
    ) -> AsyncIterator[bytes]:
        try:
            for body in formatter.opening(choices, continuous_usage):
                yield sse(body)
            if first is not None:
                if formatter.echo is not None and formatter.logprobs is not None:
                    # The prompt's scores go first: built and encoded off the loop.
                    pieces = await asyncio.to_thread(
                        lambda: [sse(b) for b in formatter.chunks(first, continuous_usage)]
                    )
                else:
                    pieces = [sse(b) for b in formatter.chunks(first, continuous_usage)]
                for piece in pieces:
                    yield piece
            async for event in events:
                for body in formatter.chunks(event, continuous_usage):
                    yield sse(body)
                if state.stopping:
                    raise stopped()
            if include_usage:
                yield sse(formatter.usage_chunk(choices))
        except APIError as exc:
            record_error(span, exc)
            yield sse(exc.body())
        except Exception as exc:
            record_error(span, exc)
            logger.exception("stream %s failed", formatter.response_id)
            yield sse(internal(formatter.response_id).body())
        end.reached = True
        yield SSE_DONE
