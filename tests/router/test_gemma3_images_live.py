"""Images to a Gemma 3-layout model through a real ``pdserve up`` stack (router + 1 prefill
+ 1 decode worker): the router writes each image as Gemma 3's processor does (its newlines
merged with the template's), the workers attend both ways inside each image, and the
replies are the offline engine's, whole and streamed, with the decode worker pulling the
KV and encoding nothing. A spelled image marker is a 400."""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine.test_gemma3_images import IMAGES
from tests.router.test_images_live import data_url
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "gemma3-vision"
MAX_TOKENS = 12


def messages(first: bytes, second: bytes) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": "What is in this picture, and how does it differ from"},
        {"type": "image_url", "image_url": {"url": data_url(second)}},
        {"type": "text", "text": "?"},
    ]}]  # fmt: skip


@pytest.fixture(scope="module")
def model_and_stack(model_factory, tmp_path_factory):
    model_dir = model_factory("gemma3_mm")
    tmp = tmp_path_factory.mktemp("gemma3-images")
    # Chunks of 5 tokens: every image (16 tokens) is reached mid-chunk on both workers.
    config = write_config(
        tmp / "config.yaml",
        model_dir,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0},
        engine={"prefill_chunk_tokens": 5},
    )
    with serving(config, tmp / "home") as stack:
        yield model_dir, stack


def test_images_give_the_offline_tokens_disaggregated(model_and_stack):
    model_dir, stack = model_and_stack
    offline = LLM(model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    client = stack.openai_client()
    seen = []
    for pair in ([IMAGES[0], IMAGES[1]], [IMAGES[1], IMAGES[0]]):
        offline_messages = [{"role": "user", "content": [
            {"type": "image", "image": pair[0]},
            {"type": "text", "text": "What is in this picture, and how does it differ from"},
            {"type": "image", "image": pair[1]},
            {"type": "text", "text": "?"},
        ]}]  # fmt: skip
        (expected,) = offline.chat(offline_messages, params, use_tqdm=False)
        tokens = expected.outputs[0].token_ids
        ask = {"model": MODEL, "messages": messages(*pair), "max_tokens": MAX_TOKENS,
               "temperature": 0.0, "extra_body": {"return_token_ids": True}}  # fmt: skip
        whole = client.chat.completions.create(**ask).choices[0]
        assert whole.model_extra["token_ids"] == tokens
        streamed = []
        for chunk in client.chat.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                streamed += choice.model_extra.get("token_ids") or []
        assert streamed == tokens
        seen.append(tokens)
    assert seen[0] != seen[1], "the images' order must change the reply"
    (decode,) = worker_stats(stack, "decode")
    (prefill,) = worker_stats(stack, "prefill")
    assert decode.blocks_pulled > 0 and decode.images_encoded == 0
    assert prefill.images_encoded == 2


def test_a_spelled_image_marker_is_a_400(model_and_stack):
    _, stack = model_and_stack
    body = {"model": MODEL, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look: <start_of_image>"},
                {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
            ]}]}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages" and "markers for 1 images" in error["message"]
