"""Images to Gemma 3- and Qwen2.5-VL-layout models through a real ``pdserve up`` stack
(router + 1 prefill + 1 decode worker): the router writes each image as the model's
processor does (Gemma 3: its newlines merged with the template's; Qwen2.5-VL: as many
placeholders as the image's size gives), the workers attend both ways inside each image
(Gemma 3) or place its tokens at 3-D positions (Qwen2.5-VL), and the replies are the
offline engine's, whole and streamed, with the decode worker pulling the KV and encoding
nothing. A spelled image marker is a 400. (Qwen3-VL's and Qwen3.5's prompts are written
as Qwen2.5-VL's; their engines' pulls are tested in ``tests/engine``.)"""

from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine.test_images import png
from tests.router.test_images_live import data_url, whole_and_streamed
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "vision"
MAX_TOKENS = 12
# Qwen2.5-VL's made model: 6 and 28 tokens (the sizes differ), Gemma 3's: 16 each.
IMAGES = [png(1, 60, 90), png(2, 200, 120)]
MARKERS = {"gemma3_mm": "<start_of_image>", "qwen2_5_vl": "<|image_pad|>"}


def messages(first: bytes, second: bytes) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": "What is in this picture, and how does it differ from"},
        {"type": "image_url", "image_url": {"url": data_url(second)}},
        {"type": "text", "text": "?"},
    ]}]  # fmt: skip


@pytest.fixture(scope="module", params=list(MARKERS))
def model_and_stack(model_factory, tmp_path_factory, request):
    model_dir = model_factory(request.param)
    tmp = tmp_path_factory.mktemp(f"{request.param}-images")
    # Chunks of 5 tokens: every image is reached mid-chunk on both workers.
    config = write_config(
        tmp / "config.yaml",
        model_dir,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0},
        engine={"prefill_chunk_tokens": 5},
    )
    with serving(config, tmp / "home") as stack:
        yield request.param, model_dir, stack


def test_images_give_the_offline_tokens_disaggregated(model_and_stack):
    _, model_dir, stack = model_and_stack
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
        assert whole_and_streamed(client, ask) == (tokens, tokens)
        seen.append(tokens)
    assert seen[0] != seen[1], "the images' order must change the reply"
    (decode,) = worker_stats(stack, "decode")
    (prefill,) = worker_stats(stack, "prefill")
    assert decode.blocks_pulled > 0 and decode.images_encoded == 0
    assert prefill.images_encoded == 2


def test_a_spelled_image_marker_is_a_400(model_and_stack):
    arch, _, stack = model_and_stack
    body = {"model": MODEL, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": f"look: {MARKERS[arch]}"},
                {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
            ]}]}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages" and "for 1 images" in error["message"]
