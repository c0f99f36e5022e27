"""The router's HTTP protocol on a real uvicorn server (httptools, a loopback socket):
request heads that are too large or too slow are refused and their connections closed,
while ordinary requests, keep-alive and large bodies pass."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from router.http_protocol import guarded_protocol


async def _echo(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"body_bytes": size}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def refused() -> list[int]:
    """The statuses of the heads the server refused, as its protocol reports them."""
    return []


@pytest.fixture(scope="module")
def port(refused) -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    small = type("Small", (guarded_protocol(refused.append),),
                 {"max_head_bytes": 4096, "head_timeout_s": 0.5})  # fmt: skip
    config = uvicorn.Config(_echo, host="127.0.0.1", port=free, loop="asyncio", http=small,
                            log_level="warning", lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (or 5 s pass)."""
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, head and body (they may come apart)."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _request(extra_headers: bytes = b"", body: bytes = b"") -> bytes:
    return (b"POST /x HTTP/1.1\r\nHost: x\r\n" + extra_headers
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip


def test_ordinary_requests_keep_alive_and_large_bodies_pass(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        body = b"x" * 200_000  # far past the head's limit: bodies are not heads
        sock.sendall(_request(body=body))
        first = _read_response(sock)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b'{"body_bytes": 200000}')
        sock.sendall(_request(b"X-Fine: " + b"a" * 3000 + b"\r\n"))  # same connection
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


def test_pipelined_requests_are_not_counted_into_the_next_head(port):
    """A read holding a whole request (body past the limit) and the start of the next
    head, the rest of which comes later: both are answered."""
    body = b"x" * 10_000
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_request(body=body) + b"POST /x HTTP/1.1\r\nHo")
        time.sleep(0.2)
        sock.sendall(b"st: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        replies = _read_all(sock)
    assert replies.count(b"HTTP/1.1 200") == 2, replies


def test_a_head_past_the_limit_is_a_431_and_the_connection_closes(port, refused):
    for before in (b"", _request()):  # a first request, and one after another
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(before + b"POST /x HTTP/1.1\r\nHost: x\r\nX-Big: ")
            with pytest.raises(OSError):  # the server closes while we still send
                for _ in range(1024):  # past a first read that took it all
                    sock.sendall(b"a" * 1024)
                    time.sleep(0.002)
            reply = _read_all(sock)
        last = reply[reply.rfind(b"HTTP/1.1 ") :]
        assert last.startswith(b"HTTP/1.1 431"), reply
        assert refused.pop() == 431
        assert json.loads(last.split(b"\r\n\r\n", 1)[1])["error"]["message"]


def test_a_slow_or_absent_head_is_a_408_and_the_connection_closes(port, refused):
    for sent in (b"", b"POST /x HTTP/1.1\r\nHo"):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert 0.4 < time.monotonic() - started < 3
        assert refused.pop() == 408
    with socket.create_connection(("127.0.0.1", port)) as sock:  # dribbled, byte by byte
        started = time.monotonic()
        with pytest.raises(OSError):
            for byte in _request(b"X-Slow: " + b"a" * 100 + b"\r\n"):
                sock.sendall(bytes([byte]))
                time.sleep(0.02)
        assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/models/d\xc3\xa9mo HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    ],
)
def test_a_head_that_is_not_http_is_a_400_in_the_envelope(port, refused, head):
    """Raw UTF-8 in the request target, a NUL in a header: uvicorn answered a plain-text
    400 that no client library reads as an API error, and nothing counted it."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"application/json" in reply, reply
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "not valid HTTP" in error["message"] and error["type"] == "invalid_request_error"
    assert refused.pop() == 400


def test_what_a_client_sends_writes_nothing_to_the_log(port, refused):
    """uvicorn wrote a WARNING for every head it could not parse and two for every
    ``Upgrade`` header (curl --http2 sends one each call): any client could fill the
    router's log (1000 requests: 183 KB). Refusals are counted; upgrades are ignored."""
    import logging

    from router.http_protocol import quiet_client_noise

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    uvicorn_logger = logging.getLogger("uvicorn.error")
    uvicorn_logger.addHandler(handler)
    quiet_client_noise()
    try:
        for head in (b"GARBAGE\r\n\r\n",
                     b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                     b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
                     b"Content-Length: 0\r\n\r\n"):  # fmt: skip
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(head)
                sock.shutdown(socket.SHUT_WR)
                reply = _read_all(sock)
            assert reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 200")), reply
        assert refused.pop() == 400
    finally:
        uvicorn_logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
