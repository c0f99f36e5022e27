"""The router's side of images (``router/images.py``), without a stack: which parts are
images and what they hold, the chat template's two ways of writing them, and their
placement on the prompt with the digests the block hashes key them by."""

from __future__ import annotations

import asyncio
import base64
import shutil

import pytest

from common.multimodal import ImageText, image_digest
from common.tokenizer import Tokenizer
from common.vision_spec import read_vision_spec
from engine.models.tokenizer_trainer import CHAT_TEMPLATE
from router.errors import APIError
from router.images import image_refs, place_images, read_images
from router.media_fetch import MediaFetcher
from router.prompts import PromptTokenizer
from router.protocol import ChatMessage


def chat(*parts: dict | str) -> list[ChatMessage]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [ChatMessage(role="user", content=content)]


def image(data: bytes) -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": "data:;base64," + base64.b64encode(data).decode()},
    }


@pytest.fixture(scope="module")
def llava(model_factory):
    return model_factory("llava")


@pytest.fixture(scope="module")
def vision(llava):
    import json

    return read_vision_spec(json.loads((llava / "config.json").read_text()), llava)


@pytest.fixture(scope="module")
def image_text(llava, vision):
    return ImageText.of(vision, Tokenizer(llava))


def read(messages, image_text, max_images: int = 2, max_bytes: int = 1 << 20) -> list[bytes]:
    """The router's reading of ``messages``' images, with no host allowed to fetch from."""
    refs = image_refs(messages, image_text, max_images)
    return asyncio.run(read_images(refs, MediaFetcher([], 1.0), max_bytes))


def test_images_are_read_in_order_and_refused_by_name(image_text):
    vision = image_text  # what ``read`` takes: the model's images, or None
    messages = chat("a", image(b"one"), "b", image(b"two"))
    assert read(messages, vision) == [b"one", b"two"]
    assert read(chat("text only"), None) == []
    part = "messages[0].content[0].image_url"
    cases = [
        (lambda: read(messages, None), "messages[0].content[1].image_url", "no vision"),
        (lambda: read(messages, vision, max_images=1), "messages", "at most 1"),
        (lambda: read(messages, vision, max_bytes=5), "messages", "larger than the 5 bytes"),
        (lambda: read(chat({"type": "image_url"}), vision), part, "needs its url"),
        (lambda: read(chat({"type": "image_url", "image_url": "data:;base64,"}), vision),
         part, "empty"),
        (lambda: read(chat({"type": "image_url", "image_url": "file:///etc/passwd"}), vision),
         part, "data:, http: or https:"),
        (lambda: read(chat({"type": "image_url", "image_url": "http://10.0.0.1/x.png"}),
                      vision), part, "allowed_media_domains (none)"),
    ]  # fmt: skip
    for call, param, words in cases:
        with pytest.raises(APIError) as raised:
            call()
        assert raised.value.param == param and words in raised.value.message
    # Of two bad parts, the first is named (the data: URLs are decoded on a thread).
    two = chat({"type": "image_url", "image_url": "data:;base64,"}, image(b"x"),
               {"type": "image_url", "image_url": "ftp://x/y.png"})  # fmt: skip
    with pytest.raises(APIError) as raised:
        read(two, vision, max_images=3)
    assert raised.value.param == part and "empty" in raised.value.message


def test_data_urls_are_decoded_off_the_event_loop(image_text, monkeypatch):
    """24 MB of base64 took 0.23 s to decode: every other stream waited for it."""
    import threading

    import router.images as images

    loop_thread, seen = threading.get_ident(), []
    decode = images.data_url_bytes

    def recording(url):
        seen.append(threading.get_ident())
        return decode(url)

    monkeypatch.setattr(images, "data_url_bytes", recording)
    assert read(chat("a", image(b"one"), image(b"two")), image_text) == [b"one", b"two"]
    assert len(seen) == 2 and loop_thread not in seen


def test_string_templates_get_the_image_token_in_the_text(llava, vision, image_text, tmp_path):
    """The made model's template reads content parts; a copy whose template reads content
    as a string (ChatML's ``message['content'] + ...`` fails on a list) gets the image
    token's text in it: both give the same ids, each marker made its run."""
    plain = tmp_path / "plain"
    shutil.copytree(llava, plain)
    (plain / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    messages = chat("What is in ", image(b"x"), " and ", image(b"y"), "?")
    args = (messages, True, None, None, False, None, None)
    token_id = vision.image_token_id
    with_parts = PromptTokenizer(Tokenizer(llava), 4096, image_text=image_text).chat_images(
        [16] * 2, *args
    )
    with_text = PromptTokenizer(Tokenizer(plain), 4096, image_text=image_text).chat_images(
        [16] * 2, *args
    )
    assert with_parts == with_text and with_parts.count(token_id) == 2 * 16
    tokens, placed = place_images(with_parts, [b"x", b"y"], vision, [16, 16])
    runs = [s.offset for s in placed.spans]
    assert tokens == with_parts and [m.offset for m in placed.messages] == runs
    assert all(tokens[o : o + 16] == [token_id] * 16 for o in runs)
    assert [s.digest for s in placed.spans] == [image_digest(b"x"), image_digest(b"y")]
    with pytest.raises(APIError, match="are not its 1 images"):
        place_images(with_parts, [b"x"], vision, [16])
    spelled = chat("What is in <image> and ", image(b"y"), "?")
    with pytest.raises(APIError, match="markers for 1 images"):
        PromptTokenizer(Tokenizer(llava), 4096, image_text=image_text).chat_images(
            [16], spelled, *args[1:]
        )
