"""What a request passes before it runs: a model this router serves, a priority its
engines honour, a router not draining, and room among the sequences in flight; the span
it is traced in; and how a running request notices that its client has gone."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.datastructures import Headers

from common.tracing import NO_SPAN, Span
from router.errors import APIError, bad_request, model_not_found, overloaded, unavailable
from router.state import RouterState

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks its client is still there

GONE = object()  # what ``until_disconnected`` returns when the client left first

# Where ``app.py`` stamps a request's arrival (``time.time_ns()``) in its ASGI scope when
# tracing is on: a request's span starts there, its tokenizing and templating included.
ARRIVAL_NS = "pdserve.arrival_ns"
REQUEST_ID = "pdserve.request_id"  # the scope's: the response's id, once it has one
# A client's own request id (``X-Request-Id``, vLLM's body ``request_id``): taken when plain.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def plain_request_id(given: str | None) -> str | None:
    """``given`` when it is a plain id (``CLIENT_REQUEST_ID``); else None."""
    return given if given is not None and CLIENT_REQUEST_ID.fullmatch(given) else None


def client_request_id(scope: Any) -> str | None:
    """The client's ``X-Request-Id``, when plain; else None."""
    return plain_request_id(Headers(scope=scope).get("x-request-id"))


# The scope's, on /v1/responses: the ``ResponseShape`` a whole chat reply is built as.
RESPONSE_SHAPE = "pdserve.response_shape"


class Admission:
    """The checks and the in-flight accounting of one router's requests, and their
    spans; every refusal is an ``APIError`` naming what to change."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names; None for the base model (or no name: absent
        or empty, as clients without a configured model send, and vLLM serves)."""
        if not model or model == self.state.model.served_name:
            return None
        if model in self.state.adapters.names():
            return model
        raise model_not_found(model)

    def check_open(self) -> None:
        if self.state.draining:
            raise unavailable("the router is draining")

    def check_priority(self, priority: int) -> None:
        if priority and not self.state.takes_priority:
            raise bad_request(
                f"priority {priority} needs engine.scheduling_policy: priority; this server "
                "serves requests in arrival order (fcfs)",
                "priority",
            )

    def admit(self, num_sequences: int, lora_name: str | None) -> Callable[[], None]:
        """Take ``num_sequences`` of the router's in-flight room (429 when it has not that
        much left) and of ``lora_name``'s; returns the call that gives them back. Callers
        check and take with no await between. Refused while the router drains: a request
        that passed ``check_open`` before the drain began and then awaited (tokenizing,
        compiling its grammar) was not yet counted, and the drain, seeing nothing in
        flight, stopped the server under it (a cut stream, or uvicorn's plain 500)."""
        state = self.state
        self.check_open()
        if state.num_inflight + num_sequences > state.config.router.max_inflight_sequences:
            raise overloaded()
        state.num_inflight += num_sequences
        release_adapter = state.adapters.admit(lora_name, num_sequences)

        def release() -> None:
            state.num_inflight -= num_sequences
            release_adapter()

        return release

    def span(
        self, request: Request, response_id: str, lora_name: str | None, num_sequences: int
    ) -> Span:
        """The span of a request about to run (``common/tracing.py``), the child of the
        client's trace context when its headers carry one; the caller ends it."""
        tracer = self.state.tracer
        if not tracer.enabled:
            return NO_SPAN
        attributes = {
            "pdserve.request_id": response_id,
            "gen_ai.request.model": lora_name or self.state.model.served_name,
            "pdserve.num_sequences": num_sequences,
        }
        name = f"{request.method} {request.url.path}"
        return tracer.start(name, request.headers.items(), attributes=attributes,
                            start_ns=request.scope.get(ARRIVAL_NS))  # fmt: skip


def record_error(span: Span, exc: BaseException) -> None:
    """What ``exc`` says of the request ``span`` traces: cancelled (the client left, the
    server stopping), the client's error (a 4xx: its status, not a failure of the
    server's, as OpenTelemetry's HTTP conventions have it), or a failure."""
    if isinstance(exc, asyncio.CancelledError):
        span.set({"pdserve.cancelled": True})
    elif isinstance(exc, APIError):
        span.set({"http.response.status_code": exc.status})
        if exc.status >= 500:
            span.fail(exc.message)
    else:
        span.fail(type(exc).__name__)


def stopped() -> APIError:
    """A reply still running when the router's drain grace ended (``RouterState.stopping``)."""
    return unavailable("the router stopped before this reply was done; send it again")


async def until_disconnected(
    request: Request, work: Awaitable, stopping: Callable[[], bool] = lambda: False
) -> Any:
    """``work``'s result; if the client goes away first, cancel it (which aborts its
    sequences on the workers) and return ``GONE``. Streams notice a gone client when a
    write fails; before the first write, and for a non-streaming response, which writes
    only at the end, the client is watched. Once ``stopping`` (the drain's grace over),
    ``stopped()`` is raised: a reply still waiting at the server's close got uvicorn's
    plain-text 500."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return GONE
            if stopping():
                raise stopped()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
