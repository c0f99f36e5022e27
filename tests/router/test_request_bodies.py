"""The body guard in front of every route, driven as ASGI: refusals in the envelope
before the route runs, and a body within bounds reaching the route whole."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse

from router.errors import APIError
from router.request_bodies import RequestBodies


def _respond(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _call(
    pieces: list[bytes], headers: dict[str, str], stall: bool = False, path: str = "/v1/x"
) -> tuple[int, dict, list]:
    """(status, body, what the route received) for a POST sent as ``pieces``."""
    routed: list[bytes] = []

    async def route(scope, receive, send) -> None:
        message = await receive()
        routed.append(message["body"])
        assert not message["more_body"]
        await JSONResponse({"ok": True})(scope, receive, send)

    async def run() -> tuple[int, dict]:
        queue: asyncio.Queue = asyncio.Queue()
        for i, piece in enumerate(pieces):
            queue.put_nowait({"type": "http.request", "body": piece,
                              "more_body": stall or i < len(pieces) - 1})  # fmt: skip
        sent: list[dict] = []

        async def send(message) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path,
                 "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
        guard = RequestBodies(route, _respond, 100, exempt={"/ping"}, idle_timeout_s=0.2)
        await guard(scope, queue.get, send)
        status = sent[0]["status"]
        closes = (b"connection", b"close") in sent[0]["headers"]
        assert closes == (status != 200)  # a refusal ends the connection
        return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))

    status, body = asyncio.run(run())
    return status, body, routed


JSON = {"content-type": "application/json"}


def test_a_body_within_bounds_reaches_the_route_whole():
    status, body, routed = _call([b'{"prompt":', b' "x"}'], JSON)
    assert (status, body, routed) == (200, {"ok": True}, [b'{"prompt": "x"}'])
    exactly = b"x" * 100
    assert _call([exactly], {**JSON, "content-length": "100"})[2] == [exactly]


def test_a_declared_length_over_the_limit_is_refused_unread():
    status, body, routed = _call([b"x" * 10], {**JSON, "content-length": "101"})
    assert status == 413 and "router.max_request_bytes" in body["error"]["message"]
    assert routed == []


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    status, body, routed = _call([b"x" * 60, b"x" * 60, b"never read"], JSON)
    assert (status, body["error"]["code"], routed) == (413, None, [])


def test_a_stalled_body_is_a_408():
    status, body, routed = _call([b'{"prompt": '], JSON, stall=True)
    assert status == 408 and "stalled" in body["error"]["message"] and routed == []


def test_a_body_trickled_below_the_least_rate_is_a_408_once_its_grace_is_over():
    """A byte every 40 s never stalled past the idle bound: a thousand such clients held
    a thousand connections as long as they liked. Here: a byte every 50 ms (20 B/s)
    against 100 B/s after 0.3 s of grace; a body sent at once passes."""

    async def run() -> tuple[int, str, float]:
        async def receive() -> dict:
            await asyncio.sleep(0.05)
            return {"type": "http.request", "body": b"x", "more_body": True}

        replies: list[dict] = []

        async def send(message) -> None:
            replies.append(message)

        async def route(scope, receive, send) -> None:
            raise AssertionError("routed")

        scope = {"type": "http", "method": "POST", "path": "/v1/x",
                 "headers": [(b"content-type", b"application/json")]}  # fmt: skip
        guard = RequestBodies(route, _respond, 10_000, idle_timeout_s=5, grace_s=0.3,
                              min_bytes_per_s=100)  # fmt: skip
        start = asyncio.get_running_loop().time()
        await guard(scope, receive, send)
        elapsed = asyncio.get_running_loop().time() - start
        return replies[0]["status"], json.loads(replies[1]["body"])["error"]["message"], elapsed

    status, message, elapsed = asyncio.run(run())
    assert status == 408 and "under 100 bytes/s" in message
    assert 0.3 <= elapsed < 1.5  # past the grace, and not the idle bound's 5 s
    assert _call([b'{"prompt": "x"}'], JSON)[0] == 200


def test_only_declared_json_and_only_outside_exempt_paths():
    for headers in ({}, {"content-type": "text/plain"}):
        status, body, routed = _call([b"{}"], headers)
        assert status == 415 and "application/json" in body["error"]["message"] and not routed
    assert _call([b""], {}, path="/ping")[0] == 200


def test_a_body_the_parser_lost_to_an_upgrade_is_refused_saying_so():
    """``curl --http2`` on http:// sends ``Upgrade: h2c``: httptools takes what follows the
    head for the new protocol, and the route got no body ("the request needs a JSON
    body"). As uvicorn delivers it: the declared body, none received."""
    upgrade = {**JSON, "upgrade": "h2c", "connection": "Upgrade, HTTP2-Settings"}
    status, body, routed = _call([b""], {**upgrade, "content-length": "9"})
    assert status == 400 and "curl --http1.1" in body["error"]["message"] and routed == []
    status, _, routed = _call([b'{"a": 1}'], {**upgrade, "content-length": "8"})
    assert (status, routed) == (200, [b'{"a": 1}'])  # (a body that arrived is kept)
    # Without "upgrade" among the Connection tokens the parser does not upgrade: an empty
    # chunked body is just empty (the route's own 400 then).
    plain = {**JSON, "upgrade": "h2c", "transfer-encoding": "chunked"}
    assert _call([b""], plain)[0] == 200
    status, body, _ = _call([b""], {**upgrade, "upgrade": "websocket", "content-length": "9"})
    assert status == 400 and "Upgrade: websocket" in body["error"]["message"]
