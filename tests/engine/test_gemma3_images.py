"""Gemma 3's vision-language layout in the engine: prompts written as its processor writes
them (each ``<start_of_image>`` made its sequence in the text, newlines merged), the pooled
projector, and image tokens that attend to each other both ways: transformers' tokens and
log-probs, whatever the chunking, the prefix cache, the backend or the disaggregation."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from common.engine_config import EngineConfig
from engine import LLM, LLMEngine, SamplingParams
from engine.images import whole_image_end
from tests.engine.test_images import (
    assert_two_ranks_give_one_ranks_tokens,
    colocated_tokens,
    disaggregated_pair,
    png,
    pulled_tokens,
)

PROMPT = (
    "<|im_start|>user\n<start_of_image>What is in this picture, and how does it differ from "
    "<start_of_image>?<|im_end|>\n<|im_start|>model\n"
)
IMAGES = [png(1), png(2, 90, 30), png(3, 56, 56)]
GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def gemma3_mm(model_factory):
    return model_factory("gemma3_mm")


def windowed(source: Path, model_dir: Path, window: int) -> Path:
    """A copy of the checkpoint whose sliding layers see ``window`` tokens."""
    shutil.copytree(source, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["sliding_window"] = window
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def hf_reference(model_dir, text: str, images: list[bytes], bidirectional: bool = True):
    """transformers' prompt ids (its processor's), greedy tokens (12) and prompt
    log-probs; ``bidirectional`` False drops the image tokens' two-way attention."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    pictures = [[Image.open(io.BytesIO(b)) for b in images]]
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    if not bidirectional:
        del inputs["token_type_ids"]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**inputs).logits[0]
        tokens = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, tokens[0, len(prompt_ids) :].tolist(), logits[:-1].log_softmax(-1)


@pytest.mark.parametrize("window", [None, 12], ids=["window-64", "window-12"])
def test_tokens_and_prompt_logprobs_equal_transformers(gemma3_mm, tmp_path, window):
    """The processor's prompt ids (its newlines merged with the text's), greedy tokens,
    and every prompt position's log-prob within 1e-4, with the sliding layers' window
    longer and shorter than an image (which still bounds what an image token sees).
    Causal image attention (what a backend that ignored the image spans would compute)
    is off by far more."""
    if window is not None:
        gemma3_mm = windowed(gemma3_mm, tmp_path / "windowed", window)
    llm = LLM(gemma3_mm)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[:2]}}
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, prompt_logprobs=1)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    token_ids, _ = llm._with_images(prompt)
    expected_ids, expected_tokens, expected_logprobs = hf_reference(gemma3_mm, PROMPT, IMAGES[:2])
    assert token_ids == expected_ids
    assert llm.tokenizer.encode("\n\n\n", add_special_tokens=False) == [
        token_ids[token_ids.index(llm.engine.arch.vision.marker_token_id) - 1]
    ], "the image's leading newlines merge with the turn's newline into one token"
    assert output.outputs[0].token_ids == expected_tokens
    got = torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]])
    rows = torch.arange(len(got))
    targets = torch.tensor(token_ids[1:])
    assert torch.allclose(got, expected_logprobs[rows, targets], atol=1e-4)
    _, _, causal = hf_reference(gemma3_mm, PROMPT, IMAGES[:2], bidirectional=False)
    assert (got - causal[rows, targets]).abs().max() > 1e-2
    assert llm.engine.leak_report() == []


def test_chat_and_token_prompts_equal_text_prompts(gemma3_mm):
    """``LLM.chat`` (the template writes a marker per image part, trimming text parts as
    Gemma's does) and a prompt of ids holding the markers give the text prompt's ids."""
    llm = LLM(gemma3_mm)
    messages = [{"role": "user", "content": [
        {"type": "image", "image": IMAGES[0]},
        {"type": "text", "text": "What is in this picture, and how does it differ from "},
        {"type": "image", "image": IMAGES[1]},
        {"type": "text", "text": "?"},
    ]}]  # fmt: skip
    trimmed = PROMPT.replace("from <start_of_image>", "from<start_of_image>")
    text_ids, _ = llm._with_images({"prompt": trimmed, "multi_modal_data": {"image": IMAGES[:2]}})
    assert llm._chat_prompt(messages, True, None)["prompt_token_ids"] == text_ids
    marked = llm.tokenizer.encode("<start_of_image> and <start_of_image>")
    ids, images = llm._with_images({"prompt_token_ids": marked,
                                    "multi_modal_data": {"image": IMAGES[:2]}})  # fmt: skip
    image_text = llm._image_text()
    sequence = [*image_text.lead_ids, *[image_text.placeholder_id] * 16, *image_text.tail_ids]
    assert ids[1 : 1 + len(sequence)] == sequence and len(images) == 2
    with pytest.raises(ValueError, match="markers"):  # one marker for two images
        llm._with_images({"prompt": "<start_of_image>", "multi_modal_data": {"image": IMAGES[:2]}})


@pytest.mark.parametrize("chunk", [5, 16, 23])
def test_chunks_compute_each_image_whole(gemma3_mm, chunk):
    """Chunks of 5, 16 and 23 tokens (16-token images): a chunk that would end inside an
    image stops before it, or grows to its end, so the image's tokens see each other;
    the tokens are the unchunked ones (a cut image fails the step: ``image_key_ends``)."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    whole = LLM(gemma3_mm)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    chunked = LLM(gemma3_mm, prefill_chunk_tokens=chunk, max_num_batched_tokens=24)
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert chunked.engine.leak_report() == []


def test_whole_image_end():
    """The scheduler's rule, on images at [10, 26) and [30, 46)."""
    from common.multimodal import ImageSpan
    from engine.images import PromptImage

    images = [PromptImage(ImageSpan(o, 16, b""), None) for o in (10, 30)]
    assert whole_image_end(images, 0, 8, 100) == 8  # text only
    assert whole_image_end(images, 0, 15, 100) == 10  # reaches an image from text: stop
    assert whole_image_end(images, 10, 15, 100) == 26  # starts at it: grow to its end
    assert whole_image_end(images, 16, 20, 100) == 26  # starts inside (a prefix hit)
    assert whole_image_end(images, 16, 20, 25) == 16  # cannot grow that far: nothing
    assert whole_image_end(images, 0, 26, 100) == 26  # ends with it
    assert whole_image_end(images, 26, 40, 100) == 30  # the next one


def test_a_budget_below_one_image_is_refused(gemma3_mm):
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is below the 16 tokens"):
        LLMEngine(gemma3_mm, EngineConfig(max_num_batched_tokens=8))


def test_a_prefix_hit_inside_an_image_gives_the_uncached_tokens(gemma3_mm):
    """A second question about the same image hits blocks that end inside it (8-token
    blocks); the image's remaining tokens still see all of it."""
    llm = LLM(gemma3_mm, block_size=8)
    fresh = LLM(gemma3_mm, block_size=8, enable_prefix_caching=False)
    first = "<|im_start|>user\nLook: <start_of_image>What is it?<|im_end|>\n<|im_start|>model\n"
    second = first.replace("What is it?", "Which colour is it?")
    prompts = [{"prompt": p, "multi_modal_data": {"image": [IMAGES[2]]}} for p in (first, second)]
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    (output,) = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    _, (image,) = llm._with_images(prompts[1])
    assert image.offset < output.num_cached_tokens < image.offset + 16  # inside the image
    expected = fresh.generate(prompts[1:], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert output.outputs[0].token_ids == expected
    assert llm.engine.leak_report() == []


def test_adjacent_images_share_no_cached_blocks_with_another_second_image(gemma3_mm):
    """Two images with no token between them are one group attending both ways, so the
    first's KV depends on the second: "[A][B]" and then "[A][C]" shared A's blocks (16
    cached tokens) and gave other tokens than an uncached run."""
    llm = LLM(gemma3_mm, block_size=16)
    fresh = LLM(gemma3_mm, block_size=16, enable_prefix_caching=False)
    image_id = llm.engine.arch.vision.image_token_id
    ids = [1, 40, 41, *[image_id] * 32, 42, 43]  # A at 3..18, the second at 19..34
    first = {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGES[:2]}}
    second = {"prompt_token_ids": ids, "multi_modal_data": {"image": [IMAGES[0], IMAGES[2]]}}
    llm.generate([first], GREEDY, use_tqdm=False)
    (output,) = llm.generate([second], GREEDY, use_tqdm=False)
    assert output.num_cached_tokens == 0
    expected = fresh.generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert output.outputs[0].token_ids == expected
    assert llm.engine.leak_report() == []


def test_disaggregated_equals_colocated(gemma3_mm):
    """Prefill on one engine, decode on another (the KV pulled, once failed and
    recomputed there): the colocated tokens."""
    llm = LLM(gemma3_mm)
    prompts = [
        llm._with_images({"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}})
        for i in (0, 1)
    ]
    expected = colocated_tokens(gemma3_mm, prompts)
    prefill, decode, puller = disaggregated_pair(gemma3_mm, EngineConfig(prefill_chunk_tokens=5))
    for fail in (True, False):
        assert pulled_tokens(prefill, decode, puller, prompts, fail) == expected, fail
    for engine in (prefill, decode):
        assert engine.leak_report() == []


def test_two_ranks_give_one_ranks_tokens(gemma3_mm):
    """Tensor parallelism: the other rank gets the step's key ends with its rows."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    assert_two_ranks_give_one_ranks_tokens(gemma3_mm, prompts, prefill_chunk_tokens=7)


def test_adjacent_images_attend_as_one_group_as_in_transformers(gemma3_mm):
    """Two images with no token between them (a prompt of ids; Gemma 3's processor never
    writes them so): transformers' mask makes them one group, whose tokens all see each
    other; so does the engine, in chunks of 5 too. A group past the step's budget could
    never be scheduled and is refused."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from engine.errors import InvalidRequestError

    image_id = LLM(gemma3_mm).engine.arch.vision.image_token_id
    ids = [1, 40, 41, *[image_id] * 32, 42, 43]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGES[:2]}}
    model = AutoModelForImageTextToText.from_pretrained(gemma3_mm, dtype=torch.float32).eval()
    processor = Gemma3ImageProcessorPil.from_pretrained(gemma3_mm)
    pixels = processor(images=[Image.open(io.BytesIO(b)) for b in IMAGES[:2]],
                       return_tensors="pt")["pixel_values"]  # fmt: skip
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values=pixels,
                       token_type_ids=(input_ids == image_id).long()).logits[0]  # fmt: skip
    expected = logits[:-1].log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    for llm in (LLM(gemma3_mm), LLM(gemma3_mm, prefill_chunk_tokens=5)):
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        got = torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]])
        assert torch.allclose(got, expected, atol=1e-4)
        assert llm.engine.leak_report() == []
    small = LLMEngine(gemma3_mm, EngineConfig(max_num_batched_tokens=24))
    token_ids, images = LLM(gemma3_mm)._with_images(prompt)
    with pytest.raises(InvalidRequestError, match="32 tokens attend to each other"):
        small.add_request("r", token_ids, GREEDY, images=images)
    assert small.leak_report() == []
