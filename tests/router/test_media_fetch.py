"""Fetching images from allowed hosts (``router/media_fetch.py``) against a real HTTP
server on 127.0.0.1: URLs that do not parse are 400s (they were 500s with a traceback),
a fetch is bounded in all by ``media_fetch_timeout_s`` (httpx bounds each read: a host
sending a byte at a time held it for as long as it liked), and the request's fetches
share one byte budget as they read."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from router.errors import APIError
from router.images import read_images
from router.media_fetch import MediaFetcher

PARAM = "messages[0].content[0].image_url"


class Host(BaseHTTPRequestHandler):
    """/drip: a byte every 0.2 s for 10 s; /600: 600 bytes."""

    def do_GET(self) -> None:
        drip = self.path == "/drip"
        size = 50 if drip else 600
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        if not drip:
            self.wfile.write(b"x" * size)
            return
        for _ in range(size):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.2)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Host)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def read(urls: list[str], max_bytes: int = 1 << 20, timeout_s: float = 5.0) -> list[bytes]:
    refs = [(f"messages[0].content[{i}].image_url", url) for i, url in enumerate(urls)]
    return asyncio.run(read_images(refs, MediaFetcher(["127.0.0.1"], timeout_s), max_bytes))


def refusal(call) -> APIError:
    with pytest.raises(APIError) as raised:
        call()
    assert raised.value.status == 400
    return raised.value


def test_urls_that_do_not_parse_are_400s_naming_the_part(host):
    port = host.split(":")[1]
    local = f"http://127.0.0.1:{port}"
    for url in ["http://[::1/x.png", "https://[evil/x.png", "http://127.0.0.1:abc/x.png",
                "http://127.0.0.1\n:9/x.png", f"{local}/x\t.png", f"{local}/\x7f.png",
                f"{local}/a b.png"]:  # fmt: skip
        error = refusal(lambda url=url: read([url]))
        assert error.param == PARAM, (url, error.message)


def test_a_fetch_ends_within_its_timeout_however_slowly_the_host_sends(host):
    start = time.monotonic()
    error = refusal(lambda: read([f"http://{host}/drip"], timeout_s=1.0))
    assert "took over 1 s" in error.message and error.param == PARAM
    assert time.monotonic() - start < 4  # (the host sends for 10 s)


def test_the_fetches_of_a_request_share_its_byte_budget(host):
    assert read([f"http://{host}/600"], max_bytes=1000) == [b"x" * 600]
    error = refusal(lambda: read([f"http://{host}/600", f"http://{host}/600"], max_bytes=1000))
    assert "larger than the 1000 bytes" in error.message
