"""Request bodies are JSON, declared so: any other body is a 415 that says what to send.

Without this, FastAPI reads a ``text/plain`` or form body as raw bytes and the client
gets a 400 about a "dictionary" it never sent. A body with no ``Content-Type`` is refused
too, as vLLM and FastAPI's strict default do: a browser page may send such a body (or a
``text/plain`` one) to a local server without asking first, so only a declared JSON body
can come from a script the server never allowed. ``application/json`` with parameters
(``; charset=utf-8``) and ``+json`` types (``application/merge-patch+json``) are JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import APIError


def unsupported_media_type(media_type: str) -> APIError:
    return APIError(
        415,
        f"Unsupported Media Type: the body must be JSON (Content-Type: application/json), "
        f"not {media_type}",
    )


def is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


class JsonBodies:
    """ASGI middleware: a POST whose ``Content-Type`` is not JSON gets ``respond(error)``
    (the OpenAI envelope) before any route reads it."""

    def __init__(
        self, app: ASGIApp, respond: Callable[[APIError], Response], exempt: Collection[str]
    ) -> None:
        """``exempt``: paths that take no body (probes)."""
        self.app, self.respond, self.exempt = app, respond, exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] not in self.exempt
        ):
            content_type = Headers(scope=scope).get("content-type", "")
            if not is_json(content_type):
                media_type = content_type.split(";", 1)[0].strip() or "none"
                await self.respond(unsupported_media_type(media_type))(scope, receive, send)
                return
        await self.app(scope, receive, send)
