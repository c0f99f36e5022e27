"""uvicorn's httptools protocol with bounds on a request's head (its request line and
headers), which no ASGI middleware sees until it is complete.

- **At most ``MAX_HEAD_BYTES``** (64 KiB, as much as nginx's default buffers, counted
  after the read the head began in): a larger head is a 431 and the connection closes.
  httptools gathers a header value by joining bytes, so a 150 MB header held the
  router's event loop for 22 s: every stream and health probe waited, and the router
  took its decode workers for frozen.
- **Within ``HEAD_TIMEOUT_S``** of the connection opening or the request beginning: a
  client that dribbles its head (slowloris) or opens a connection and sends nothing
  gets a 408 and the connection closes, instead of holding a socket for ever (20,000
  such connections used up the router's file descriptors). Between requests uvicorn's
  own keep-alive timeout applies.
- **A head that is not HTTP** (raw UTF-8 in the request target, a NUL in a header) is a
  400 in the error envelope, counted with the other refusals (uvicorn's was plain text).
- **Nothing a client sends is logged per request** (``quiet_client_noise``): uvicorn
  wrote a WARNING for each head it could not parse and two for each ``Upgrade`` header
  (``curl --http2`` sends one on every call), so any client could fill the router's log
  (1000 requests: 183 KB). Refused heads are counted in the metrics; an upgrade is
  ignored, the request served over HTTP/1.1, where the parser loses a body sent with
  it: ``request_bodies.py`` refuses such a request, saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.errors import APIError

MAX_HEAD_BYTES = 64 << 10
HEAD_TIMEOUT_S = 30.0


def _refusal(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP response carrying the error envelope; the connection closes after."""
    body = json.dumps(APIError(status, message).body(), separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S

    @staticmethod
    def on_refusal(status: int) -> None:
        """Told of each refused head (``guarded_protocol`` sets it)."""

    _head_bytes: int = 0  # of the current head, in pieces after the one it began in
    _head_open: bool = False  # a request's head has begun and is not complete
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that sends nothing at all

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # A piece that begins a head may also hold earlier pipelined requests and their
        # bodies, so only the pieces after it count: the limit is 64 KiB past the first
        # read (at most 256 KiB), enough to stop the joining that grows with each piece.
        continues_head = self._head_open
        super().data_received(data)
        if continues_head and self._head_open:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                message = f"the request's head is larger than {self.max_head_bytes} bytes"
                self._refuse(431, "Request Header Fields Too Large", message)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open, self._head_bytes = True, 0
        if self._head_timer is None:  # a request after another on this connection
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._head_done()
        super().on_headers_complete()

    def _unsupported_upgrade_warning(self) -> None:
        """An ``Upgrade`` (h2c, a WebSocket) is ignored, without uvicorn's two WARNINGs."""

    def send_400_response(self, msg: str) -> None:
        """httptools could not parse the head (uvicorn's ``msg`` says only that)."""
        message = ("the request is not valid HTTP/1.1 (its request line or a header); a "
                   "URL's non-ASCII characters must be %-encoded")  # fmt: skip
        self._refuse(400, "Bad Request", message)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(
            self.head_timeout_s, self._refuse, 408, "Request Timeout",
            f"the request's head did not arrive within {self.head_timeout_s:g} s",
        )  # fmt: skip

    def _head_done(self) -> None:
        self._head_open = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer and close; while an earlier pipelined request's response is still
        going out, close without answering (a refusal written now would land inside it)."""
        self._head_done()
        if self.transport.is_closing():
            return
        self.on_refusal(status)
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_refusal(status, reason, message))
        self.transport.close()


def guarded_protocol(on_refusal: Callable[[int], None]) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http``, calling ``on_refusal(status)`` for each
    head it refuses (the router counts them with its other refusals)."""
    return type("RouterHttpProtocol", (GuardedHttpToolsProtocol,),
                {"on_refusal": staticmethod(on_refusal)})  # fmt: skip


# What uvicorn logs per client request (its message for an unparsable head).
_CLIENT_NOISE = frozenset({"Invalid HTTP request received."})


class _ClientNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _CLIENT_NOISE


def quiet_client_noise() -> None:
    """Drop uvicorn's per-request WARNING for a head it cannot parse (the protocol counts
    and answers it); called once where the router's server is built."""
    uvicorn_logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ClientNoise) for f in uvicorn_logger.filters):
        uvicorn_logger.addFilter(_ClientNoise())
