"""The OpenAI-compatible HTTP gateway (FastAPI). Routes translate HTTP to choices and
choices back to JSON or SSE; placement and transport live in ``dispatch.py``.

Errors are turned into the OpenAI envelope here and only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from common.config import ScoreMethod
from common.structured_output import STRUCTURED_OUTPUT
from common.tokenizer import KeptTokens, TokenizerError, TooManyTokens
from proto import pdserve_pb2 as pb
from router.choices import build_choices, merge_choices, new_id
from router.detokenizer import IncrementalDetokenizer
from router.embeddings import LANES, EmbeddingsBody, embed_all
from router.errors import (
    APIError,
    bad_request,
    context_too_long,
    internal,
    model_not_found,
    overloaded,
    unauthorized,
    unavailable,
)
from router.formatting import SSE_DONE, Formatter, ToolFormat, sse
from router.harmony import Harmony, call_constraint
from router.harmony import opening_of as harmony_opening
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    FieldError,
    LoadLoraAdapterRequest,
    NamedToolChoice,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    error_field,
    texts_of,
    token_lists_of,
)
from router.reasoning import PROMPT_TAIL_TOKENS, Reasoning, opening_of
from router.request_bodies import RequestBodies
from router.response_output import ResponseShape, translate_stream
from router.responses import renamed, to_chat, without_oldest_turn
from router.scoring import NoRoomForDocument, pairs_of, rerank_document, score_document
from router.state import RouterState
from router.structured import check as check_constraint
from router.structured import structured_output_of
from router.tool_parsers import MistralCalls, tool_format_of
from router.tools import call_schemas

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks its client is still there

_OPEN_PATHS = {"/health", "/ping", "/version", "/metrics"}  # as vLLM: probes need no key
_GONE = object()  # what ``until_disconnected`` returns when the client left first


def model_permission(created: int) -> dict[str, Any]:
    """OpenAI's old (and vLLM's) permission entry: sampling and log-probs allowed."""
    return {
        "id": new_id("modelperm"),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


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


class _AdmittedStream(StreamingResponse):
    """A streamed response that, however it ends, gives its admission back and closes the
    choices' event stream (which aborts sequences still running): also when the client
    left before the first byte, when the body's generator never starts and its own
    ``finally`` would never run."""

    def __init__(self, content: AsyncIterator[bytes], events: AsyncGenerator,
                 release: Callable[[], None], **kwargs: Any) -> None:  # fmt: skip
        super().__init__(content, **kwargs)
        self._events = events
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            with anyio.CancelScope(shield=True):  # runs even when the client's gone
                await self._events.aclose()


class _ApiKeyAuth:
    """Bearer-key check for every path but health and metrics. A plain ASGI middleware,
    not ``@app.middleware("http")``: that one wraps ``receive``, and behind it
    ``Request.is_disconnected`` never reports a gone client."""

    def __init__(
        self, app: ASGIApp, state: RouterState, respond: Callable[[APIError], Response]
    ) -> None:
        self.app, self.state, self.respond = app, state, respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.state.config.router.api_keys
        if scope["type"] == "http" and keys and scope["path"] not in _OPEN_PATHS:
            header = Headers(scope=scope).get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            # Compare with every key in constant time, so timing reveals nothing.
            matched = False
            for key in keys:
                matched |= hmac.compare_digest(token.encode(), key.encode())
            if not matched:
                await self.respond(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: RouterState) -> FastAPI:
    try:
        version_text = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version_text = "unknown"
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)

    def refused(error: APIError) -> JSONResponse:
        """Every refusal's answer (routes, the key check, the body guard), counted."""
        state.metrics.refused(error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return refused(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        message, param = error_field(first, field_at=1)  # after "body"
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", message)
            return await api_error(request, bad_request(f"the body is not valid JSON: {reason}"))
        if param is None and first.get("type") == "missing":
            message = "the request needs a JSON body"
        return await api_error(request, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths, wrong methods, bodies that are not even text: the envelope too."""
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}"
        error = APIError(exc.status_code, message, param=None)
        error.headers.update(exc.headers or {})
        return await api_error(request, error)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        """The one exception a request reaches without a bug: a JSON schema or tool
        nested ~500 deep parses, then fails whatever walks it. A handler of its own, so
        that no traceback is logged (every one would be 80 lines a client could send)."""
        return await api_error(request, bad_request("the request is nested too deeply"))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug: answered with the envelope and an id. Starlette raises the exception on
        after this answer, so the server logs its traceback right after this line."""
        error_id = new_id("err")
        logger.error("request %s %s failed (%s): %r", request.method, request.url.path,
                     error_id, exc)  # fmt: skip
        return await api_error(request, internal(error_id))

    # Added first, so it runs after the key check: a stranger learns nothing from a 415
    # and sends no body the router reads.
    app.add_middleware(
        RequestBodies,
        respond=refused,
        max_bytes=state.config.router.max_request_bytes,
        exempt=_OPEN_PATHS,
    )
    app.add_middleware(_ApiKeyAuth, state=state, respond=refused)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        ready = bool(state.pool.candidates_for_health())
        return JSONResponse({"status": "ok" if ready else "no_workers"},
                            status_code=200 if ready else 503)  # fmt: skip

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness route: the same answer as /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": version_text}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.running.set(state.num_running)
        state.metrics.waiting.set(state.num_waiting)
        workers = list(state.pool.workers.values())
        state.metrics.observe_workers(
            {worker.worker_id: worker.stats for worker in workers},
            {worker.worker_id for worker in workers if worker.available},
        )
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(lora_name: str | None = None) -> dict[str, Any]:
        """vLLM's card: ``root`` is the checkpoint (an adapter's directory, where this
        router knows it), ``parent`` the base model of an adapter, ``permission`` the one
        open entry clients written for OpenAI's old API read."""
        name = lora_name or state.model.served_name
        root = str(state.model.model_dir) if lora_name is None else state.adapters.path_of(name)
        return {
            "id": name,
            "object": "model",
            "created": state.started_at,
            "owned_by": "pdserve",
            "root": root,
            "parent": None if lora_name is None else state.model.served_name,
            "max_model_len": state.model.max_model_len,
            "permission": [model_permission(state.started_at)],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = state.adapters.names()
        return {"object": "list", "data": [model_card(), *map(model_card, adapters)]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> dict[str, Any]:
        """Load an adapter on every worker (``router/lora_adapters.py``)."""
        return await state.adapters.load(body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> dict[str, Any]:
        return await state.adapters.unload(body.lora_name)

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        return model_card(check_model(model))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            tokens = await asyncio.to_thread(
                apply_template, body.messages, body.add_generation_prompt,
                tool_dicts(body.tools), body.chat_template_kwargs, body.continue_final_message,
            )  # fmt: skip
        else:
            tokens = await asyncio.to_thread(
                state.tokenizer.encode, body.prompt or "", body.add_special_tokens
            )
        reply = {"tokens": tokens, "count": len(tokens), "max_model_len": state.model.max_model_len}
        if body.return_token_strs:
            reply["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
        return reply

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if any(t < 0 or t >= state.tokenizer.vocab_size for t in body.tokens):
            raise bad_request("token ids must be in the vocabulary", "tokens")
        # As vLLM (transformers' decode): special tokens' text kept, so that /tokenize's
        # ids (a BOS, a chat template's markers) come back as the text they stand for.
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora_name = check_model(body.model)
        # Tokenizing a long prompt takes a while: off the event loop, so that other
        # requests' streams keep flowing meanwhile.
        prompts = await asyncio.to_thread(completion_prompts, body)
        return await respond(
            request, body, prompts, chat=False, logprobs=body.logprobs, lora_name=lora_name
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        lora_name = check_model(body.model)
        # A Harmony reply (GPT-OSS) is read by the one format, its tool calls included.
        harmony = state.harmony_ids is not None
        try:
            parser = state.config.router.tool_call_parser
            tool_format = None if harmony else tool_format_of(body, parser)
        except FieldError as error:
            raise bad_request(str(error), error.param) from None
        prompt = await asyncio.to_thread(
            apply_template, body.messages, body.add_generation_prompt,
            tool_dicts(body.tools), body.template_kwargs, body.continue_final_message,
            prompt_limit(body), prompt_window(body),
        )  # fmt: skip
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tail = state.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        if harmony:
            calls = bool(body.tools) and body.tool_choice != "none"
            forced = None  # "required" or a named function: a grammar makes the call
            if body.calls_tools:
                forced = call_constraint(call_schemas(body), state.tokenizer)
            named = isinstance(body.tool_choice, NamedToolChoice)
            reader = Harmony(harmony_opening(tail, calls), calls, body.include_reasoning,
                             forced, named)  # fmt: skip
            return await respond(request, body, [prompt], chat=True, logprobs=logprobs,
                                 harmony=reader, lora_name=lora_name,
                                 keep_special=state.harmony_ids)  # fmt: skip
        # A tool format whose markers are special tokens reads them in the text.
        keep = state.tool_marker_ids if isinstance(tool_format, MistralCalls) else frozenset()
        return await respond(request, body, [prompt], chat=True, logprobs=logprobs,
                             tool_format=tool_format, reasoning=reasoning_of(body, tail),
                             lora_name=lora_name, keep_special=keep)  # fmt: skip

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """Each input's embedding: its last token's hidden state, from whichever worker
        placement picks (``router/embeddings.py``)."""
        lora_name = check_model(body.model)
        check_pooling(body)
        response_id = new_id("embd")
        done = await pooled(request, body, body.input, "input", lora_name, response_id,
                            normalize=body.normalize)  # fmt: skip
        if done is None:
            return Response(status_code=499)  # nobody is listening; the work is aborted
        prompts, replies = done
        name = lora_name or state.model.served_name
        num_tokens = sum(map(len, prompts))
        document = EmbeddingsBody(response_id, name, replies, num_tokens, body.encoding_format)
        if document.small:
            return Response(document.whole(), media_type="application/json")
        return StreamingResponse(document.pieces(), media_type="application/json")

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest, request: Request) -> Response:
        """vLLM's score API: each (text_1, text_2) pair's relevance, by the configured
        method (``router/scoring.py``)."""
        try:
            pairs = pairs_of(body.text_1, body.text_2)
        except ValueError as exc:
            raise bad_request(str(exc), "text_2") from None
        response_id = new_id("score")
        scored = await score_pairs(request, body, pairs, ("text_1", "text_2"), response_id)
        if scored is None:
            return Response(status_code=499)
        return JSONResponse(score_document(response_id, *scored))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request) -> Response:
        """Jina's and Cohere's rerank (as vLLM serves it): the documents by relevance to
        the query, best first, the ``top_n`` best (0: all)."""
        documents = body.texts()
        pairs = [(body.query, document) for document in documents]
        response_id = new_id("rerank")
        scored = await score_pairs(request, body, pairs, ("query", "documents"), response_id)
        if scored is None:
            return Response(status_code=499)
        shown = documents if body.return_documents else None
        return JSONResponse(rerank_document(response_id, *scored, shown, body.top_n))

    def check_pooling(body: EmbeddingRequest | ScoreRequest | RerankRequest) -> None:
        if state.draining:
            raise unavailable("the router is draining")
        check_priority(body.priority)

    async def score_pairs(
        request: Request,
        body: ScoreRequest | RerankRequest,
        pairs: list[tuple[str, str]],
        params: tuple[str, str],
        response_id: str,
    ) -> tuple[list[float], int, str] | None:
        """Each pair's score, the prompt tokens computed and the model's name; None when
        the client left first. ``params`` name the query's field and the document's, for
        errors. The texts computed run as ``<response_id>-<i>``."""
        lora_name = check_model(body.model)
        check_pooling(body)
        scorer = state.scorer
        query_param, document_param = params
        logits = scorer.method is ScoreMethod.TOKEN_LOGITS
        truncating = body.truncate_prompt_tokens is not None
        if logits or not truncating:  # each query fits, before 2,048 prompts copy it
            queries = list(dict.fromkeys(query for query, _ in pairs))
            if logits:  # with the template around it (an empty document)
                queries = [scorer.prompt_text(query, "") for query in queries]
            await asyncio.to_thread(prompt_ids, queries, query_param,
                                    state.model.max_model_len,
                                    body.add_special_tokens)  # fmt: skip
        fit = logits and truncating
        if fit:  # the documents are cut, not the prompts (``Scorer.fit_documents``)
            keep = truncation_keep(body.truncate_prompt_tokens)
            try:
                pairs = await asyncio.to_thread(scorer.fit_documents, state.tokenizer, pairs,
                                                keep, body.add_special_tokens)  # fmt: skip
            except NoRoomForDocument as exc:
                raise bad_request(str(exc), "truncate_prompt_tokens") from None
        plan = await asyncio.to_thread(scorer.plan, pairs)
        done = await pooled(request, body, plan.texts, document_param, lora_name, response_id,
                            normalize=scorer.normalize, logit_token_ids=scorer.token_ids,
                            truncate=not fit)  # fmt: skip
        if done is None:
            return None
        prompts, replies = done
        vectors = [np.frombuffer(reply.embedding, dtype="<f4") for reply in replies]
        expected = len(scorer.token_ids) if logits else len(vectors[0])
        if any(len(vector) != expected or not expected for vector in vectors):
            # A worker from before logit_token_ids (mid-upgrade) sends a hidden state.
            sizes = sorted({len(vector) for vector in vectors})
            logger.warning("request %s: vectors of %s floats, %d expected", response_id,
                           sizes, expected)  # fmt: skip
            raise unavailable(
                f"a worker answered with vectors of {sizes} floats where "
                f"{expected} were asked for (a worker of an older version?)"
            )
        name = lora_name or state.model.served_name
        return plan.combine(vectors), sum(map(len, prompts)), name

    async def pooled(
        request: Request,
        body: EmbeddingRequest | ScoreRequest | RerankRequest,
        value: str | list,
        param: str,
        lora_name: str | None,
        response_id: str,
        *,
        normalize: bool,
        logit_token_ids: tuple[int, ...] = (),
        truncate: bool = True,
    ) -> tuple[list[list[int]], list[pb.EmbedResponse]] | None:
        """``value``'s prompts (texts or ids, blaming ``param``) and each one's ``Embed``
        reply, in order; None when the client left first (the work is then aborted).
        ``truncate``: apply the body's ``truncate_prompt_tokens`` (False: done before)."""
        truncating = truncate and body.truncate_prompt_tokens is not None
        limit = None if truncating else state.model.max_model_len
        kept = prompt_window(body) if truncating else None
        prompts = await asyncio.to_thread(prompt_ids, value, param, limit,
                                          body.add_special_tokens, kept)  # fmt: skip
        if kept is not None:
            prompts = [kept.ids(prompt) for prompt in prompts]
        max_model_len = state.model.max_model_len
        for tokens in prompts:
            if len(tokens) > max_model_len:
                raise context_too_long(len(tokens), None, max_model_len, param)
        lora = state.adapters.resolve(lora_name) if lora_name is not None else None
        # Its calls in flight are its sequences (``router/embeddings.py``).
        lanes = min(len(prompts), LANES, state.config.router.max_inflight_sequences)
        release = admit(lanes, lora_name)
        try:
            work = embed_all(state.dispatcher, prompts, response_id, state.model.block_size,
                             lora, body, lanes, normalize=normalize,
                             logit_token_ids=logit_token_ids)  # fmt: skip
            replies = await until_disconnected(request, work)
        except Exception as exc:
            if isinstance(exc, APIError):
                raise
            logger.exception("request %s failed", response_id)
            raise internal(response_id) from None
        finally:
            release()
        return None if replies is _GONE else (prompts, replies)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, stateless, over the chat path (``router/responses.py``)."""
        chat = to_chat(body)
        shape = ResponseShape(body, body.model or state.model.served_name)
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
        return JSONResponse(shape.resolved(json.loads(reply.body)))

    # ------------------------------------------------------------------ helpers

    def check_model(model: str | None) -> str | None:
        """The LoRA adapter ``model`` names; None for the base model (or no name)."""
        if model is None or model == state.model.served_name:
            return None
        if model in state.adapters.names():
            return model
        raise model_not_found(model)

    def tool_dicts(tools) -> list[dict[str, Any]] | None:
        """Tools as chat templates see them (OpenAI's shape)."""
        return [tool.model_dump(exclude_none=True) for tool in tools or ()] or None

    def apply_template(
        messages, add_generation_prompt: bool, tools=None, template_kwargs=None,
        continue_final_message: bool = False, max_tokens: int | None = None,
        kept: KeptTokens | None = None,
    ) -> list[int]:  # fmt: skip
        """``max_tokens``: a longer prompt is refused before it is tokenized whole.
        ``kept``: what truncation will keep (only that much of the text is tokenized)."""
        try:
            return state.tokenizer.apply_chat_template(
                [m.for_template() for m in messages], add_generation_prompt, tools,
                template_kwargs, continue_final_message, max_tokens, kept,
            )  # fmt: skip
        except TooManyTokens as exc:
            raise too_long(exc, "messages") from None
        except TokenizerError as exc:
            raise bad_request(str(exc), exc.param or "messages") from None
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    def reasoning_of(body: ChatCompletionRequest, tail: str) -> Reasoning | None:
        """How this reply's thinking is told apart (None: no reasoning parser).
        ``tail``: the prompt's end, special tokens kept."""
        opening = opening_of(state.config.router.reasoning_parser, tail)
        return None if opening is None else Reasoning(opening, body.include_reasoning)

    def prompt_limit(body) -> int | None:
        """How many tokens a prompt may have before it is refused untokenized: the
        context, unless the request truncates its prompt to fit."""
        return state.model.max_model_len if body.truncate_prompt_tokens is None else None

    def prompt_window(body) -> KeptTokens | None:
        """vLLM's ``truncate_prompt_tokens``: what it keeps of each prompt's tokens, the
        last ``keep`` (-1: as many as the context holds), cut after the chat template, or
        the first ones where ``truncation_side`` is "right"; None when the request does
        not truncate."""
        if body.truncate_prompt_tokens is None:
            return None
        keep = truncation_keep(body.truncate_prompt_tokens)
        return KeptTokens(keep, from_end=body.truncation_side != "right")

    def too_long(exc: TooManyTokens, param: str) -> APIError:
        return context_too_long(exc.at_least, None, state.model.max_model_len, param,
                                at_least=True)  # fmt: skip

    def completion_prompts(body: CompletionRequest) -> list[list[int]]:
        return prompt_ids(body.prompt, "prompt", prompt_limit(body), kept=prompt_window(body))

    def prompt_ids(
        value: str | list,
        param: str,
        limit: int | None,
        add_special_tokens: bool = True,
        kept: KeptTokens | None = None,
    ) -> list[list[int]]:
        """A prompt field's ids (``prompt``, ``input``: a text, texts, ids or lists of
        ids): texts encoded, the first past ``limit`` tokens refused at once (one surely
        past it before it is encoded whole), each checked to be non-empty and in the
        vocabulary, blaming ``param``. ``kept``: what truncation will keep of each (only
        that much of a text is tokenized)."""
        texts = texts_of(value)
        if texts is not None:
            prompts = []
            for text in texts:
                try:
                    tokens = state.tokenizer.encode(text, add_special_tokens, limit, kept)
                except TooManyTokens as exc:
                    raise too_long(exc, param) from None
                if limit is not None and len(tokens) > limit:  # not after 1,000 more texts
                    raise context_too_long(len(tokens), None, limit, param)
                prompts.append(tokens)
        else:
            prompts = token_lists_of(value)
        vocab = state.tokenizer.vocab_size
        for tokens in prompts:
            if not tokens:
                raise bad_request(f"{param} must not be empty", param)
            if any(t < 0 or t >= vocab for t in tokens):
                raise bad_request(f"{param} token ids must be in [0, {vocab})", param)
        return prompts

    def check_priority(priority: int) -> None:
        if priority and not state.takes_priority:
            raise bad_request(
                f"priority {priority} needs engine.scheduling_policy: priority; this server "
                "serves requests in arrival order (fcfs)",
                "priority",
            )

    def admit(num_sequences: int, lora_name: str | None) -> Callable[[], None]:
        """Take ``num_sequences`` of the router's in-flight room (429 when it has not that
        much left) and of ``lora_name``'s; returns the call that gives them back. Callers
        check and take with no await between."""
        if state.num_inflight + num_sequences > state.config.router.max_inflight_sequences:
            raise overloaded()
        state.num_inflight += num_sequences
        release_adapter = state.adapters.admit(lora_name, num_sequences)

        def release() -> None:
            state.num_inflight -= num_sequences
            release_adapter()

        return release

    def truncation_keep(keep: int) -> int:
        """``truncate_prompt_tokens`` as a number of tokens (-1: the context's)."""
        max_model_len = state.model.max_model_len
        if keep > max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens must be <= max_model_len={max_model_len} (or -1), "
                f"got {keep}",
                "truncate_prompt_tokens",
            )
        return max_model_len if keep == -1 else keep

    def echo_texts(body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What ``echo`` repeats of each prompt: the text sent, or token ids decoded (and
        what truncation kept of them)."""
        texts = body.prompt_texts
        if texts is not None and body.truncate_prompt_tokens is None:
            return texts
        return [state.tokenizer.decode(tokens, skip_special_tokens=False) for tokens in prompts]

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
    ):
        """``lora_name``: the adapter the request's ``model`` named; None: the base model.
        ``keep_special``: special tokens kept in the text (markers a parser reads)."""
        if state.draining:
            raise unavailable("the router is draining")
        vocab = state.model.vocab_size or state.tokenizer.vocab_size  # what the engine checks
        for name, token_ids in (("stop_token_ids", body.stop_token_ids),
                                ("logit_bias", body.logit_bias),
                                ("allowed_token_ids", body.allowed_token_ids)):  # fmt: skip
            if any(t >= vocab for t in token_ids or ()):
                raise bad_request(f"{name} must be in [0, {vocab}) (token ids)", name)
        window = prompt_window(body)
        if window is not None:
            prompts = [window.ids(prompt) for prompt in prompts]
        check_priority(body.priority)
        num_sequences = len(prompts) * body.n
        limit = state.config.router.max_inflight_sequences
        if num_sequences > limit:
            raise bad_request(
                f"the request asks for {num_sequences} sequences (prompts x n); this server "
                f"runs at most {limit} at once",
                "n" if body.n > 1 else "prompt",
            )
        try:
            constraint = structured_output_of(body)
            calls_format = tool_format or harmony  # what may constrain the output to calls
            if calls_format is not None and calls_format.structured is not None:
                if constraint is not None:  # the calls are the output's constraint
                    raise FieldError(f"{constraint[0]} cannot be combined with tool_choice "
                                     "required or a named function", constraint[0])  # fmt: skip
                constraint = ("tools", calls_format.structured)
            thinks = reasoning or harmony
            if constraint is not None and thinks is not None:  # it applies after thinking
                constraint = (constraint[0], thinks.constrained(constraint[1]))
            if constraint is not None:  # a large schema compiles for a while: off the loop
                await asyncio.to_thread(check_constraint, state.grammar_compiler, *constraint)
        except FieldError as error:
            raise bad_request(str(error), error.param) from None
        structured = constraint[1] if constraint is not None else None
        sampling = state.sampling_params(body, logprobs, chat, structured)
        echo = None
        scored = [] if body.prompt_logprobs is None else [body.prompt_logprobs]
        if not chat and body.echo:
            echo = await asyncio.to_thread(echo_texts, body, prompts)
            if logprobs is not None:  # the prompt's log-probs come first
                scored.append(logprobs)
        elif chat and body.echo and body.messages[-1].role == "assistant":
            continued = body.messages[-1].text()  # the message the reply continues
            echo = [continued] if continued else None  # (a content of null stays null)
        if scored:  # the engine scores once, with the larger top n; each use cuts its own
            sampling.prompt_logprobs = max(scored)
        if sampling.HasField("max_tokens") and sampling.min_tokens > sampling.max_tokens:
            raise bad_request(
                f"min_tokens must be <= max_tokens={sampling.max_tokens}, got "
                f"{sampling.min_tokens}",
                "min_tokens",
            )
        echo_only = not chat and body.echo_only
        if echo_only:  # one token is computed with the prompt's scores; it is not shown
            sampling.max_tokens = 1
        response_id = new_id("chatcmpl" if chat else "cmpl")
        keep = keep_special or frozenset()
        choices = build_choices(
            response_id,
            prompts,
            body.n,
            sampling,
            body.stop_strings,
            state.model.max_model_len,
            state.model.block_size,
            lambda stop: IncrementalDetokenizer(
                state.tokenizer,
                stop,
                body.min_tokens,
                keep,
                body.include_stop_str_in_output,
                body.skip_special_tokens,
            ),
            body.cache_salt,
            state.adapters.resolve(lora_name) if lora_name is not None else None,
            prompt_param="messages" if chat else "prompt",
            priority=body.priority,
            echo_only=echo_only,
            eos_token_ids=state.model.eos_token_ids,
            main_eos_id=state.tokenizer.eos_token_id,
        )
        formatter = Formatter(
            response_id,
            lora_name or state.model.served_name,
            chat,
            logprobs,
            state.token_text,
            body.return_token_ids,
            echo,
            body.prompt_logprobs,
            tool_format,
            reasoning,
            harmony,
            body.return_tokens_as_token_ids,
        )
        release = admit(num_sequences, lora_name)  # no await since: nothing else got in
        arrival = time.perf_counter()
        events = merge_choices(state.dispatcher, choices, state.metrics, arrival)
        if constraint is not None:
            events = _blaming(events, constraint[0])

        async def collect() -> None:
            async for _ in events:
                pass

        # A stream's headers wait for its first event, so that what fails before anything
        # was generated (no worker, a worker refusing the input) is an HTTP status, as
        # without streaming, and not a 200 with an error event.
        work = anext(events, None) if body.stream else collect()
        try:
            first = await until_disconnected(request, work)
        except BaseException as exc:
            release()
            await events.aclose()
            if isinstance(exc, APIError) or not isinstance(exc, Exception):
                raise
            logger.exception("request %s failed", response_id)
            raise internal(response_id) from None
        if first is _GONE:
            release()
            await events.aclose()
            return Response(status_code=499)  # nobody is listening; the work is aborted
        if body.stream:
            return _AdmittedStream(
                stream(
                    formatter, choices, first, events, body.include_usage, body.continuous_usage
                ),
                events,
                release,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        release()
        return JSONResponse(formatter.final(choices))

    async def until_disconnected(request: Request, work: Awaitable) -> Any:
        """``work``'s result; if the client goes away first, cancel it (which aborts its
        sequences on the workers) and return ``_GONE``. Streams notice a gone client when
        a write fails; before the first write, and for a non-streaming response, which
        writes only at the end, the client is watched."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return _GONE
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def stream(
        formatter: Formatter,
        choices,
        first,
        events: AsyncIterator,
        include_usage: bool,
        continuous_usage: bool,
    ) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield sse(formatter.chunk(first, continuous_usage))
            async for event in events:
                yield sse(formatter.chunk(event, continuous_usage))
            if include_usage:
                yield sse(formatter.usage_chunk(choices))
        except APIError as exc:
            yield sse(exc.body())
        except Exception:
            logger.exception("stream %s failed", formatter.response_id)
            yield sse(internal(formatter.response_id).body())
        yield SSE_DONE

    return app
