"""Images through a real ``pdserve up`` stack (router + 1 prefill + 1 decode worker) on a
LLaVA-layout model: OpenAI image_url parts with data: URLs give the offline engine's tokens,
whole and streamed, disaggregated (the decode worker pulls the prompt's KV and encodes no
image); the prefix cache and the router's index key blocks by image; http URLs are fetched
from allowed hosts only (a real HTTP server on 127.0.0.1); bad images are 400s in the
OpenAI error envelope."""

from __future__ import annotations

import base64
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine.test_images import IMAGES, PROMPT, png
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "llava"
MAX_TOKENS = 12
MAX_REQUEST_BYTES = 1 << 20  # and so the most a request's images may hold


class ImageHost(BaseHTTPRequestHandler):
    """/0.png, /1.png: IMAGES; /moved: a redirect; /big: past the request's budget;
    /drip: a byte every 0.1 s for 8 s, how long its reader kept reading put in DRIPPED."""

    def do_GET(self) -> None:
        if self.path == "/drip":
            self._drip()
            return
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/0.png")
            self.end_headers()
            return
        if self.path == "/big":
            body = b"x" * (MAX_REQUEST_BYTES + 1)
        elif self.path in ("/0.png", "/1.png"):
            body = IMAGES[int(self.path[1])]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drip(self) -> None:
        start = time.monotonic()
        self.send_response(200)
        self.send_header("Content-Length", "80")
        self.end_headers()
        try:
            for _ in range(80):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the reader went away
            pass
        DRIPPED.put(time.monotonic() - start)

    def log_message(self, *args) -> None:  # quiet
        pass


DRIPPED: queue.Queue[float] = queue.Queue()


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def messages(first: str, second: str) -> list[dict]:
    """PROMPT's question as OpenAI content parts (the template renders exactly PROMPT)."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": first}},
        {"type": "text", "text": " and how does it differ from "},
        {"type": "image_url", "image_url": second},  # vLLM's short form: the URL alone
        {"type": "text", "text": "?"},
    ]}]  # fmt: skip


@pytest.fixture(scope="module")
def llava_and_stack(model_factory, tmp_path_factory):
    llava = model_factory("llava")
    tmp = tmp_path_factory.mktemp("images")
    config = write_config(
        tmp / "config.yaml",
        llava,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0, "max_images_per_request": 2,
                "allowed_media_domains": ["127.0.0.1"], "max_request_bytes": MAX_REQUEST_BYTES},
    )  # fmt: skip
    with serving(config, tmp / "home") as stack:
        yield llava, stack


def whole_and_streamed(client, ask: dict) -> tuple[list[int], list[int]]:
    """The token ids of the chat request ``ask`` answered whole, and streamed."""
    whole = client.chat.completions.create(**ask).choices[0].model_extra["token_ids"]
    streamed = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            streamed += choice.model_extra.get("token_ids") or []
    return whole, streamed


def chat(stack, body: dict) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, **body}  # fmt: skip
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)


def test_images_give_the_offline_tokens_disaggregated(llava_and_stack):
    llava, stack = llava_and_stack
    offline = LLM(llava)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    client = stack.openai_client()
    (decode_before,) = worker_stats(stack, "decode")
    prompt_ids = offline.tokenizer.encode(PROMPT, add_special_tokens=False)
    seen = []
    for pair in ([IMAGES[0], IMAGES[1]], [IMAGES[0], IMAGES[2]], [IMAGES[1], IMAGES[0]]):
        # The template's text, as the router tokenizes it (no BOS added).
        prompt = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": pair}}
        (expected,) = offline.generate([prompt], params, use_tqdm=False)
        tokens = expected.outputs[0].token_ids
        ask = {"model": MODEL, "messages": messages(*map(data_url, pair)),
               "max_tokens": MAX_TOKENS, "temperature": 0.0,
               "extra_body": {"return_token_ids": True}}  # fmt: skip
        assert whole_and_streamed(client, ask) == (tokens, tokens)
        seen.append(tokens)
    assert len({tuple(t) for t in seen}) == 3, "each pair of images must change the reply"
    (decode,) = worker_stats(stack, "decode")
    (prefill,) = worker_stats(stack, "prefill")
    assert decode.blocks_pulled > decode_before.blocks_pulled  # disaggregated
    assert decode.images_encoded == 0  # the decode worker pulled every image's KV
    # 6 requests of 2 images, 3 distinct images: each encoded once on the prefill worker
    # (later requests find its blocks cached, or its rows in the encoder cache).
    assert prefill.images_encoded == 3


def test_bad_images_are_400s_naming_the_part(llava_and_stack):
    _, stack = llava_and_stack
    good = data_url(IMAGES[0])
    cases = [
        (["https://example.com/cat.png", good], "messages[0].content[1].image_url",
         "allowed_media_domains (127.0.0.1)"),
        (["data:image/png;base64,%%%", good], "messages[0].content[1].image_url", "base64"),
        (["data:image/png,raw", good], "messages[0].content[1].image_url", "base64"),
        ([data_url(b"\x89PNG\r\n\x1a\n not really"), good], "images", "not a readable image"),
    ]  # fmt: skip
    for (first, second), param, words in cases:
        reply = chat(stack, {"messages": messages(first, second)})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert words in error["message"], error
    three = messages(good, good)
    three[0]["content"].append({"type": "image_url", "image_url": {"url": good}})
    reply = chat(stack, {"messages": three})
    assert reply.status_code == 400 and "max_images_per_request" in reply.json()["error"]["message"]
    spelled = [{"role": "user", "content": [{"type": "text", "text": "look: <image>"},
                                            {"type": "image_url", "image_url": good}]}]  # fmt: skip
    reply = chat(stack, {"messages": spelled})
    assert reply.status_code == 400
    assert "image tokens themselves" in reply.json()["error"]["message"]
    reply = chat(stack, {"messages": messages(good, good), "truncate_prompt_tokens": 20})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "truncate_prompt_tokens"
    # The stack still serves.
    assert chat(stack, {"messages": messages(good, data_url(png(7)))}).status_code == 200


def test_images_from_allowed_hosts_are_fetched(llava_and_stack, image_host):
    """An http URL on an allowed host gives the tokens its bytes inline give; another
    host's (``localhost`` is not ``127.0.0.1``), a redirect, a 404 and a body past the
    request's budget are 400s naming the part, and nothing else is fetched."""
    _, stack = llava_and_stack
    inline = chat(stack, {"messages": messages(data_url(IMAGES[0]), data_url(IMAGES[1]))})
    fetched = chat(stack, {"messages": messages(f"http://{image_host}/0.png",
                                                f"http://{image_host}/1.png")})  # fmt: skip
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["token_ids"] == inline.json()["choices"][0]["token_ids"]
    port = image_host.split(":")[1]
    second = "messages[0].content[3].image_url"
    cases = [
        (f"http://localhost:{port}/1.png", "is not one"),
        (f"http://{image_host}/moved", "redirects are not followed"),
        (f"http://{image_host}/missing.png", "answered HTTP 404"),
        (f"http://{image_host}/big", "larger than"),
    ]
    for url, words in cases:
        reply = chat(stack, {"messages": messages(data_url(IMAGES[0]), url)})
        assert reply.status_code == 400, (url, reply.text)
        error = reply.json()["error"]
        assert error["param"] == second and words in error["message"], (url, error)


def test_a_client_gone_while_its_images_are_fetched_stops_the_fetch(llava_and_stack, image_host):
    """The router fetched on for a client that had left (the fetch came before the
    disconnect watch): a slow host held it 20 s after a client gave up after 2."""
    _, stack = llava_and_stack
    body = {"model": MODEL, "max_tokens": 4,
            "messages": messages(data_url(IMAGES[0]), f"http://{image_host}/drip")}  # fmt: skip
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=1.0)
    assert DRIPPED.get(timeout=20) < 4.0  # read for about 1 s, not the host's 8


def test_the_responses_api_takes_input_images(llava_and_stack):
    """A Responses request's ``input_image`` parts are the chat request's image parts:
    the same reply; a bad one is a 400 naming ``input``."""
    _, stack = llava_and_stack
    first, second = data_url(IMAGES[0]), data_url(IMAGES[2])
    text = chat(stack, {"messages": messages(first, second)}).json()
    parts = [{"type": "input_text", "text": "What is in "},
             {"type": "input_image", "image_url": first, "detail": "auto"},
             {"type": "input_text", "text": " and how does it differ from "},
             {"type": "input_image", "image_url": second},
             {"type": "input_text", "text": "?"}]  # fmt: skip
    body = {"model": MODEL, "input": [{"role": "user", "content": parts}],
            "max_output_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    (message,) = [item for item in reply.json()["output"] if item["type"] == "message"]
    assert message["content"][0]["text"] == text["choices"][0]["message"]["content"]
    parts[1] = {"type": "input_image", "file_id": "file-123"}
    reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    parts[1] = {"type": "input_image", "image_url": "http://10.0.0.1/x.png"}
    reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    assert "allowed_media_domains" in reply.json()["error"]["message"]
