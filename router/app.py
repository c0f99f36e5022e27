"""The OpenAI-compatible HTTP gateway (FastAPI): the app, its key check and body guard,
the probes, models and tokenizer routes. The generating routes are in
``generation_routes.py``, the pooling ones (embeddings, score, rerank) in
``pooling_routes.py``; placement and transport live in ``dispatch.py``.

Errors are turned into the OpenAI envelope here and only here.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tokenizer import TooManyTokens
from router.admission import ARRIVAL_NS, REQUEST_ID, Admission, client_request_id
from router.choices import new_id
from router.errors import APIError, bad_request, internal, model_not_found, unauthorized
from router.generation_routes import add_generation_routes
from router.host_check import LoopbackHosts, guards_hosts
from router.json_body import Body, document_bodies
from router.pooling_routes import add_pooling_routes
from router.prompts import PromptTokenizer, tool_dicts
from router.protocol import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from router.request_bodies import RequestBodies
from router.state import RouterState
from router.validation_errors import error_message

logger = logging.getLogger(__name__)

_OPEN_PATHS = {"/health", "/ping", "/version", "/metrics"}  # as vLLM: probes need no key
# The most tokens /tokenize counts (when the context is shorter): ~40 MB of the router's
# memory for the ids and their JSON.
MAX_TOKENIZE_TOKENS = 1 << 20


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


class _Arrival:
    """Stamps each request's arrival (``time.time_ns()``) in its scope, where its span
    will start (``admission.ARRIVAL_NS``): reading the body, tokenizing and templating
    are in the trace. Added only when tracing is on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ARRIVAL_NS] = time.time_ns()
        await self.app(scope, receive, send)


class _OpenRequests:
    """Counts the HTTP requests the router is answering (``RouterState.num_open_requests``):
    the drain waits for them, not only for the sequences admitted (``router/main.py``)."""

    def __init__(self, app: ASGIApp, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.state.num_open_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_open_requests -= 1


class _RequestIds:
    """``X-Request-Id`` on every response, errors and refusals included (OpenAI sends one;
    the OpenAI SDK shows it as ``_request_id`` and in its errors): the client's own, when
    it sent a plain one (vLLM's), else the response's id (``chatcmpl-...``, which a 500's
    message and the router's log name), else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = request_id_of(scope) or new_id("req")
                headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(scope: Scope) -> str | None:
    """The request's id for its ``X-Request-Id``: the client's, when plain, else the
    response's, once it has one."""
    return client_request_id(scope) or scope.get(REQUEST_ID)


def create_app(state: RouterState) -> FastAPI:
    try:
        version_text = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version_text = "unknown"
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    escape = not state.config.router.parse_special_tokens_in_messages
    prompt_tokenizer = PromptTokenizer(
        state.tokenizer, state.model.max_model_len, escape, state.image_text
    )
    admission = Admission(state)

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
        message, param = error_message(list(exc.errors()), field_at=1)  # after "body"
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
        # The response's id once it has one, so its header, message and log line agree.
        error_id = request.scope.get(REQUEST_ID) or new_id("err")
        client_id = request_id_of(request.scope)
        also = f", client id {client_id}" if client_id not in (None, error_id) else ""
        logger.error("request %s %s failed (%s%s): %r", request.method, request.url.path,
                     error_id, also, exc)  # fmt: skip
        reply = await api_error(request, internal(error_id))
        # Answered outside ``_RequestIds`` (Starlette's outermost middleware runs this).
        reply.headers["x-request-id"] = client_id or error_id
        return reply

    # Added first, so it runs after the key check: a stranger learns nothing from a 415
    # and sends no body the router reads.
    app.add_middleware(
        RequestBodies,
        respond=refused,
        max_bytes=state.config.router.max_request_bytes,
        exempt=_OPEN_PATHS,
        routes=app.routes,
    )
    app.add_middleware(_ApiKeyAuth, state=state, respond=refused)
    app.add_middleware(_RequestIds)  # around the refusals too
    app.add_middleware(_OpenRequests, state=state)
    if state.tracer.enabled:
        app.add_middleware(_Arrival)  # the first thing a request meets (but CORS's)
    origins = state.config.router.allowed_origins
    if origins:  # outside these: a browser's preflight carries no key, and needs no trace
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip
    router = state.config.router
    if guards_hosts(router.host, router.api_keys, router.allowed_hosts):  # outermost
        allowed = [*router.allowed_hosts, router.host]
        app.add_middleware(LoopbackHosts, allowed=allowed, respond=refused)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:  # (Retry-After: as new requests get it, deploy/README.md)
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": "1"})  # fmt: skip
        ready = bool(state.pool.candidates_for_health())
        return JSONResponse({"status": "ok" if ready else "no_workers"},
                            status_code=200 if ready else 503)  # fmt: skip

    @app.get("/ping", operation_id="ping_get")
    @app.post("/ping", operation_id="ping_post")  # (one id for both: a duplicate in OpenAPI)
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
    async def load_lora_adapter(body: Body[LoadLoraAdapterRequest]) -> dict[str, Any]:
        """Load an adapter on every worker (``router/lora_adapters.py``)."""
        return await state.adapters.load(body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: Body[UnloadLoraAdapterRequest]) -> dict[str, Any]:
        return await state.adapters.unload(body.lora_name)

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        if not model:  # (a request body's empty name means the base model; a path's, none)
            raise model_not_found(model)
        return model_card(admission.lora_name(model))

    @app.post("/tokenize")
    async def tokenize(body: Body[TokenizeRequest]) -> dict[str, Any]:
        """Any length up to ``MAX_TOKENIZE_TOKENS`` (or the context, if longer): a text
        past it is a 400 before it is tokenized whole (a 31 MB prompt grew the router by
        4.5 GB and held its tokenizing threads 25 s; a security audit, 2026-12-02). Past
        the context is counted, as in vLLM: a client may count a document to cut it."""
        admission.lora_name(body.model)
        limit = max(state.model.max_model_len, MAX_TOKENIZE_TOKENS)
        if body.messages is not None:
            tokens = await asyncio.to_thread(
                prompt_tokenizer.chat, body.messages, body.add_generation_prompt,
                tool_dicts(body.tools), body.chat_template_kwargs, body.continue_final_message,
                limit, too_long=lambda exc, param: too_many_to_count(exc.at_least, limit, param),
            )  # fmt: skip
        else:
            tokens = await asyncio.to_thread(prompt_text_ids, body.prompt or "", body, limit)
        if len(tokens) > limit:
            param = "prompt" if body.messages is None else "messages"
            raise too_many_to_count(len(tokens), limit, param)
        reply = {"tokens": tokens, "count": len(tokens), "max_model_len": state.model.max_model_len}
        if body.return_token_strs:
            strings = state.tokenizer.convert_ids_to_tokens
            reply["token_strs"] = await asyncio.to_thread(strings, tokens)
        return reply

    @app.post("/detokenize")
    async def detokenize(body: Body[DetokenizeRequest]) -> dict[str, Any]:
        """On a thread, as ``/tokenize``: 8M ids held the event loop (every stream and
        health answer) for 6 s (a security audit)."""
        admission.lora_name(body.model)
        return {"prompt": await asyncio.to_thread(detokenized, body.tokens)}

    def prompt_text_ids(text: str, body: TokenizeRequest, limit: int) -> list[int]:
        try:
            return state.tokenizer.encode(text, body.add_special_tokens, limit)
        except TooManyTokens as exc:
            raise too_many_to_count(exc.at_least, limit, "prompt") from None

    def too_many_to_count(at_least: int, limit: int, param: str) -> APIError:
        return bad_request(f"the {param} has at least {at_least} tokens; /tokenize counts up "
                           f"to {limit}", param)  # fmt: skip

    def detokenized(tokens: list[int]) -> str:
        vocab_size = state.tokenizer.vocab_size  # (once: it asks the tokenizer each time)
        if any(t < 0 or t >= vocab_size for t in tokens):
            raise bad_request("token ids must be in the vocabulary", "tokens")
        # As vLLM (transformers' decode): special tokens' text kept, so that /tokenize's
        # ids (a BOS, a chat template's markers) come back as the text they stand for.
        return state.tokenizer.decode(tokens, skip_special_tokens=False)

    add_generation_routes(app, state, prompt_tokenizer, admission)
    add_pooling_routes(app, state, prompt_tokenizer, admission)
    document_bodies(app)
    return app
