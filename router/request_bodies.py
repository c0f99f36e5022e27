"""What a POST body must be before any route reads it: JSON, declared so (415), at most
``max_bytes`` (413), and sent without long pauses (408). The body is read here, once,
and handed to the route as one message.

- **Declared JSON.** Without this check FastAPI reads a ``text/plain`` or form body as
  raw bytes and the client gets a 400 about a "dictionary" it never sent. A body with no
  ``Content-Type`` is refused too, as vLLM and FastAPI's strict default do: a browser page
  may send such a body (or a ``text/plain`` one) to a local server without a CORS
  preflight, so only a declared JSON body can come from a script the server allowed.
  ``application/json`` with parameters (``; charset=utf-8``) and ``+json`` types count.
- **Bounded.** The route would hold the whole body, then its parsed form, then its
  tokens: a 50 MB prompt took the router to 11.7 GB and 86 s before its 400. A
  ``Content-Length`` over the limit is refused before a byte of the body is read; a
  chunked body as soon as it passes the limit.
- **Sent steadily.** A client that stops mid-body (a ``Content-Length`` it never sends)
  held its connection and its request for ever; now each wait for more of the body is
  bounded by ``idle_timeout_s``. And a body must arrive at ``min_bytes_per_s`` on
  average once ``grace_s`` has passed (Kestrel's rule, with its 240 B/s): a byte every
  40 s never paused past the idle bound, so a thousand such clients held a thousand
  connections (and file descriptors) as long as they liked (a security audit,
  2026-12-02). The grace is a credit of ``grace_s * min_bytes_per_s`` bytes (2400): a
  JSON body of any real client arrives within it, but one that pauses past the grace
  before its first byte is refused (the idle bound alone allowed 60 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import APIError

# How long a request body may pause between its pieces; how slowly it may arrive on
# average past its first seconds.
BODY_IDLE_TIMEOUT_S = 60.0
BODY_GRACE_S, BODY_MIN_BYTES_PER_S = 10.0, 240.0


def is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


class _Refused(Exception):
    def __init__(self, error: APIError) -> None:
        self.error = error


class RequestBodies:
    """ASGI middleware for POSTs outside ``exempt`` (paths that take no body): refusals
    go out as ``respond(error)`` (the OpenAI envelope). ``routes`` (None: every path):
    the app's, read on each call, so only a path some POST route serves is guarded; a
    POST to a path nobody serves is the app's 404 (a client without a Content-Type got
    415 for ``/v1/responses/{id}/cancel``, which does not exist)."""

    def __init__(
        self,
        app: ASGIApp,
        respond: Callable[[APIError], Response],
        max_bytes: int,
        exempt: Collection[str] = (),
        idle_timeout_s: float = BODY_IDLE_TIMEOUT_S,
        routes: Sequence[Any] | None = None,
        grace_s: float = BODY_GRACE_S,
        min_bytes_per_s: float = BODY_MIN_BYTES_PER_S,
    ) -> None:
        self.app, self.respond, self.exempt = app, respond, exempt
        self.max_bytes, self.idle_timeout_s = max_bytes, idle_timeout_s
        self.grace_s, self.min_bytes_per_s = grace_s, min_bytes_per_s
        self.routes = routes

    def _guards(self, path: str) -> bool:
        if path in self.exempt:
            return False
        if self.routes is None:
            return True
        return any(getattr(route, "path", None) == path and "POST" in (getattr(
            route, "methods", None) or ()) for route in self.routes)  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not self._guards(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(Headers(scope=scope), receive)
        except _Refused as refused:
            # The connection closes after the answer: the rest of a body nobody will
            # read is not uploaded (or trickled) for nothing.
            refused.error.headers["Connection"] = "close"
            await self.respond(refused.error)(scope, receive, send)
            return
        await self.app(scope, _replaying(body, receive), send)

    async def _read(self, headers: Headers, receive: Receive) -> bytes:
        content_type = headers.get("content-type", "")
        if not is_json(content_type):
            media_type = content_type.split(";", 1)[0].strip() or "none"
            raise _Refused(
                APIError(
                    415,
                    "Unsupported Media Type: the body must be JSON "
                    f"(Content-Type: application/json), not {media_type}",
                )
            )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise _Refused(self._too_large())
        pieces: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            # This wait ends at the earlier of two bounds: the idle one, or the moment
            # the body's average rate falls below the least allowed.
            slow_at = start + self.grace_s + size / self.min_bytes_per_s
            idle_at = loop.time() + self.idle_timeout_s
            try:  # (asyncio.timeout: 3.11's wait_for could swallow a cancel)
                async with asyncio.timeout_at(min(idle_at, slow_at)):
                    message = await receive()
            except TimeoutError:
                why = f"the request body stalled for {self.idle_timeout_s:g} s"
                if slow_at < idle_at:
                    why = f"the request body arrived at under {self.min_bytes_per_s:g} bytes/s"
                raise _Refused(APIError(408, why)) from None
            if message["type"] == "http.disconnect":
                raise _Refused(APIError(400, "the client left while sending its body"))
            piece = message.get("body", b"")
            size += len(piece)
            if size > self.max_bytes:
                raise _Refused(self._too_large())
            pieces.append(piece)
            if not message.get("more_body", False):
                body = b"".join(pieces)
                if not body and _lost_to_an_upgrade(headers, declared):
                    # The HTTP parser took what followed an Upgrade head (curl --http2 on
                    # http://) for the new protocol: the body is lost, and the route
                    # said "the request needs a JSON body".
                    raise _Refused(APIError(400, "the request asks to upgrade its connection "
                                            f"(Upgrade: {headers['upgrade']}); this server "
                                            "speaks HTTP/1.1, and a body sent with an "
                                            "upgrade is lost: send it without one (curl "
                                            "--http1.1)"))  # fmt: skip
                return body

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} "
            "bytes (router.max_request_bytes)",
        )


def _lost_to_an_upgrade(headers: Headers, declared: str) -> bool:
    """Whether the parser upgraded (an ``Upgrade`` header, ``upgrade`` among the
    ``Connection`` tokens) a request that declared a body."""
    tokens = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    asks = "upgrade" in headers and "upgrade" in tokens
    return asks and (declared not in ("", "0") or "transfer-encoding" in headers)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the connection's own messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
