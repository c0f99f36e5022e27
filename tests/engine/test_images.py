"""A vision-language model (LLaVA's layout) in the engine: images in the prompt give
transformers' tokens and log-probs, whatever the chunking; the prefix cache keys blocks
by the images they hold; a disaggregated run equals a colocated one, and the decode
engine encodes no image unless it must recompute the prompt."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from common.engine_config import EngineConfig
from common.multimodal import ImageInput
from engine import LLM, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.request import RemoteKV
from tests.engine.local_puller import LocalPuller
from tests.engine.test_disaggregation import run

PROMPT = (
    "<|im_start|>user\nWhat is in <image> and how does it differ from <image>?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)


def png(seed: int, height: int = 40, width: int = 50) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


IMAGES = [png(1), png(2, 90, 30), png(3, 28, 28)]


@pytest.fixture(scope="module")
def llava(model_factory):
    return model_factory("llava")


def counting_encoder(engine: LLMEngine) -> list[int]:
    """Make the engine's encoder count the images it encodes (appended per call)."""
    encoder = engine.runner.vision
    calls: list[int] = []
    forward = encoder.forward

    def counted(pixels: torch.Tensor) -> torch.Tensor:
        calls.append(pixels.shape[0])
        return forward(pixels)

    encoder.forward = counted
    return calls


def request(llm: LLM, images: list[bytes], prompt: str = PROMPT):
    """(token ids, ImageInputs) of ``prompt`` with ``images``, as ``LLM`` places them."""
    return llm._with_images({"prompt": prompt, "multi_modal_data": {"image": images}})


def hf_reference(model_dir, token_ids: list[int], images: list[bytes]):
    """transformers' greedy tokens (12) and prompt log-probs, pixels from its processor."""
    from PIL import Image
    from transformers import LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = CLIPImageProcessorPil.from_pretrained(model_dir)
    pixels = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"]).logits[0]
        tokens = model.generate(input_ids=ids, pixel_values=pixels["pixel_values"],
                                max_new_tokens=12, do_sample=False)  # fmt: skip
    return tokens[0, len(token_ids) :].tolist(), logits[:-1].float().log_softmax(-1)


def test_tokens_and_prompt_logprobs_equal_transformers(llava):
    """Two images in one prompt, in both orders: greedy tokens equal transformers', and
    every prompt position's log-prob (image placeholders' included) within 1e-4."""
    llm = LLM(llava)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, prompt_logprobs=1)
    outputs = []
    for images in (IMAGES[:2], IMAGES[1::-1]):
        token_ids, _ = request(llm, images)
        (output,) = llm.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": images}}], params, use_tqdm=False
        )
        expected_tokens, expected_logprobs = hf_reference(llava, token_ids, images)
        assert output.outputs[0].token_ids == expected_tokens
        for position, lp in enumerate(output.prompt_logprobs[1:]):
            assert lp.logprob == pytest.approx(
                expected_logprobs[position, lp.token_id].item(), abs=1e-4
            ), position
        outputs.append(output.outputs[0].token_ids)
    assert outputs[0] != outputs[1], "the images' order must change what the model says"
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize(
    "before,after", [(0, 9), (5, 0), (0, 0), (16, 16)], ids=["first", "last", "alone", "aligned"]
)
def test_images_at_the_prompts_edges_equal_transformers(llava, before, after):
    """An image first in the prompt, last (its last placeholder's state samples the
    first token), alone, and on block boundaries (positions 16..31 of 16-token blocks):
    transformers' tokens."""
    llm = LLM(llava)
    vision = llm.engine.arch.vision
    rng = torch.Generator().manual_seed(before * 31 + after)
    text = torch.randint(5, 2000, (before + after,), generator=rng).tolist()
    ids = text[:before] + [vision.image_token_id] + text[before:]
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [IMAGES[2]]}}
    (output,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    token_ids, _ = llm._with_images(prompt)
    expected, _ = hf_reference(llava, token_ids, [IMAGES[2]])
    assert output.outputs[0].token_ids == expected
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("chunk", [5, 16, 23])
def test_chunked_prompts_split_images_and_encode_each_once(llava, chunk):
    """Chunks that end inside an image's placeholders (5 and 23 tokens; 16-token images)
    give the unchunked tokens, and each image is encoded once: its rows are kept on the
    request between the chunks that read them (no encoder cache here), then dropped."""
    whole = LLM(llava)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    chunked = LLM(llava, prefill_chunk_tokens=chunk, encoder_cache_bytes=0)
    calls = counting_encoder(chunked.engine)
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    assert sum(calls) == 4, calls  # two images per prompt, each encoded once
    assert chunked.engine.leak_report() == []


def test_prefix_cache_keys_blocks_by_their_images(llava):
    """The same text with another image must not reuse the first image's KV (its
    placeholder ids are the same); the same image again does, and is not encoded."""
    llm = LLM(llava, block_size=8)
    calls = counting_encoder(llm.engine)
    one = {"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[:2]}}
    other = {"prompt": PROMPT, "multi_modal_data": {"image": [IMAGES[0], IMAGES[2]]}}
    fresh = LLM(llava, block_size=8, enable_prefix_caching=False)
    expected_other = fresh.generate([other], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    first = llm.generate([one], GREEDY, use_tqdm=False)[0]
    second = llm.generate([other], GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected_other
    # Shared: the blocks before the second image (its first image is the same).
    token_ids, inputs = request(llm, [IMAGES[0], IMAGES[2]])
    assert second.num_cached_tokens == inputs[1].offset // 8 * 8
    calls.clear()
    again = llm.generate([one], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == (len(token_ids) - 1) // 8 * 8
    assert calls == []  # both images' placeholders were cached
    assert llm.engine.leak_report() == []


def test_the_encoder_cache_is_kept_per_cache_salt(llava):
    """An image another tenant sent was not encoded again (the encoder cache was keyed by
    the image alone): the time to first token told a tenant what another had sent, the
    side channel cache_salt closes for the KV. Within a salt (or none) it is reused."""
    llm = LLM(llava, block_size=8)
    engine = llm.engine
    calls = counting_encoder(engine)
    token_ids, inputs = request(llm, IMAGES[:2])

    def encodes(request_id: str, salt: str | None) -> int:
        calls.clear()
        engine.add_request(request_id, token_ids, GREEDY, cache_salt=salt, images=inputs)
        while engine.has_unfinished_requests():
            engine.step()
        return sum(calls)

    assert [encodes("a", "tenant-a"), encodes("b", "tenant-b"), encodes("n", None)] == [2, 2, 2]
    engine.scheduler.kv.pool.reset_prefix_cache()  # (the KV would serve the repeats)
    assert [encodes("a2", "tenant-a"), encodes("n2", None)] == [0, 0]
    assert engine.leak_report() == []


def test_a_step_encodes_many_new_images_in_bounded_groups(llava, monkeypatch):
    """Six new images in one step are encoded in groups of at most ENCODER_BATCH (here
    4), or of ENCODER_BATCH_PIXELS (here 2 images' worth), with the tokens of one call
    for all."""
    from engine import images as engine_images

    pairs = [[png(10 + i), png(20 + i, 33, 61)] for i in range(3)]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": pair}} for pair in pairs]
    whole = LLM(llava)
    whole_calls = counting_encoder(whole.engine)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    assert whole_calls == [6]
    monkeypatch.setattr(engine_images, "ENCODER_BATCH", 4)
    grouped = LLM(llava)
    calls = counting_encoder(grouped.engine)
    got = [o.outputs[0].token_ids for o in grouped.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected and calls == [4, 2]
    assert grouped.engine.leak_report() == []
    monkeypatch.setattr(engine_images, "ENCODER_BATCH_PIXELS", 2 * 28 * 28 + 1)
    by_pixels = LLM(llava)
    calls = counting_encoder(by_pixels.engine)
    got = [o.outputs[0].token_ids for o in by_pixels.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected and calls == [2, 2, 2]
    assert by_pixels.engine.leak_report() == []


def test_the_encoder_cache_serves_an_image_asked_about_again(llava):
    """Another question after the same image shares the image's blocks but not the
    block its run ends in (it holds the new text too): the image's rows come from the
    encoder cache, not the encoder, and the tokens are a fresh engine's. Without the
    cache it is encoded again; a cache too small for one image keeps nothing."""
    first = {"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[:2]}}
    other_question = PROMPT.replace("?<|im_end|>", " in colour?<|im_end|>")
    second = {"prompt": other_question, "multi_modal_data": {"image": IMAGES[:2]}}
    expected = LLM(llava).generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for cache_bytes, encodes in ((128 << 20, 0), (0, 1), (100, 1)):
        llm = LLM(llava, block_size=8, encoder_cache_bytes=cache_bytes)
        calls = counting_encoder(llm.engine)
        llm.generate([first], GREEDY, use_tqdm=False)
        calls.clear()
        got = llm.generate([second], GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == expected
        assert got.num_cached_tokens > request(llm, IMAGES[:2])[1][1].offset  # image 2 started
        assert sum(calls) == encodes, cache_bytes
        assert len(llm.engine.runner.encoder_cache) == (2 if cache_bytes > 100 else 0)
        assert llm.engine.leak_report() == []


def test_preempted_and_resumed_requests_keep_their_images(llava):
    """Requests put back to recompute (a KV pool too small for the batch), and a
    sequence resumed elsewhere from its first k tokens (what the router's migration sends
    a new decode worker), give the unconstrained engine's tokens: their images are encoded
    again (or found in the encoder cache) for the recomputed prompt."""
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": [png(30 + i), IMAGES[i % 3]]}}
        for i in range(6)
    ]
    # 16 blocks of 16 tokens hold 256 tokens; six prompts of ~60 tokens grow to ~100 each.
    assert_preemption_and_resumption_keep_tokens(llava, prompts, num_blocks=16)


def assert_preemption_and_resumption_keep_tokens(
    model_dir, prompts: list[dict], num_blocks: int
) -> None:
    """``prompts`` (with images) give an unconstrained engine's 40 tokens on one whose
    ``num_blocks`` make it preempt, and when resumed from their first 7 tokens."""
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0)
    whole = LLM(model_dir)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]
    small = LLM(model_dir, num_blocks=num_blocks, max_model_len=256, encoder_cache_bytes=0)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected and small.engine.leak_report() == []
    resumed = LLMEngine(model_dir, EngineConfig())
    for i, prompt in enumerate(prompts):
        token_ids, images = whole._with_images(prompt)
        resumed.add_request(f"r{i}", token_ids, params, images=images,
                            output_token_ids=expected[i][:7])  # fmt: skip
    outputs = run(resumed)
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert resumed.leak_report() == []


def counting_decodes(monkeypatch) -> list[int]:
    """Count the images the engines decode (one entry per image)."""
    from engine import images as engine_images

    calls: list[int] = []
    image_pixels = engine_images.image_pixels

    def counted(data, processing):
        calls.append(1)
        return image_pixels(data, processing)

    monkeypatch.setattr(engine_images, "image_pixels", counted)
    return calls


def test_disaggregated_equals_colocated_and_decode_encodes_nothing(llava, monkeypatch):
    """Prefill on one engine, decode on another (the KV pulled): the colocated tokens,
    with no image decoded or encoded on the decode engine. A failed pull (the first
    round's first request) recomputes the prompt there, its images decoded and encoded
    then, with the same tokens."""
    llm = LLM(llava)
    prompts = [request(llm, IMAGES[i : i + 2]) for i in (0, 1)]
    expected = colocated_tokens(llava, prompts)
    prefill, decode, puller = disaggregated_pair(llava)
    decode_calls = counting_encoder(decode)
    decoded = counting_decodes(monkeypatch)
    for fail in (True, False):
        # (Only the decode engine's decodes counted: the prefill engine decoded its images.)
        got = pulled_tokens(prefill, decode, puller, prompts, fail, before_decode=decoded.clear)
        assert got == expected, fail
        # The failed pull recomputed one prompt's two images on the decode engine; the
        # pulls decode and encode none.
        assert sum(decode_calls) == 2 and len(decoded) == (2 if fail else 0)
    for engine in (prefill, decode):
        assert engine.leak_report() == []


def colocated_tokens(model_dir, prompts: list[tuple[list[int], list[ImageInput]]]) -> dict:
    """The greedy tokens of ``prompts`` (ids, images) on one engine, by request id."""
    engine = LLMEngine(model_dir, EngineConfig())
    for i, (token_ids, images) in enumerate(prompts):
        engine.add_request(f"r{i}", token_ids, GREEDY, images=images)
    tokens = {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}
    assert engine.leak_report() == []
    return tokens


def disaggregated_pair(
    model_dir, decode_config: EngineConfig | None = None
) -> tuple[LLMEngine, LLMEngine, LocalPuller]:
    """A prefill engine and a decode engine that pulls from it (``pulled_tokens``)."""
    puller = LocalPuller()
    prefill = LLMEngine(model_dir, EngineConfig())
    decode = LLMEngine(model_dir, decode_config or EngineConfig(), kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    return prefill, decode, puller


def pulled_tokens(
    prefill: LLMEngine,
    decode: LLMEngine,
    puller: LocalPuller,
    prompts: list[tuple[list[int], list[ImageInput]]],
    fail: bool,
    before_decode=lambda: None,
) -> dict[str, list[int]]:
    """One disaggregated round: ``prompts`` (ids, images) prefilled on ``prefill``, their
    KV pulled by ``decode`` (the first pull failing if ``fail``), which decodes them; the
    tokens by request id. The prefill engine's KV is released."""
    for i, (token_ids, images) in enumerate(prompts):
        prefill.add_request(f"r{i}", token_ids, GREEDY, prefill_only=True, images=images)
    firsts = run(prefill)
    before_decode()
    puller.fail_next = fail
    for i, (token_ids, images) in enumerate(prompts):
        first = firsts[f"r{i}"]
        states = tuple(prefill.held_state_block_ids(f"r{i}"))  # a hybrid model's
        remote = RemoteKV(f"l{i}", len(token_ids), tuple(first.kv_block_ids), "prefill-0",
                          state_block_ids=states)  # fmt: skip
        decode.add_request(f"r{i}", token_ids, GREEDY, remote_kv=remote, images=images,
                           output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    got = {rid: out.outputs[0].token_ids for rid, out in run(decode).items()}
    for i in range(len(prompts)):
        assert prefill.release_kv(f"r{i}")
    return got


def test_pulled_requests_preempted_on_the_decode_engine_decode_their_images(llava, monkeypatch):
    """A decode engine too small for its batch preempts requests whose KV it pulled;
    they recompute their prompts, their images decoded only then: the colocated tokens."""
    llm = LLM(llava)
    pairs = [[png(40 + i), IMAGES[i % 3]] for i in range(6)]
    prompts = [request(llm, pair) for pair in pairs]
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0)
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pairs],
                              params, use_tqdm=False)
    ]  # fmt: skip
    puller = LocalPuller()
    prefill = LLMEngine(llava, EngineConfig())
    decode = LLMEngine(llava, EngineConfig(num_blocks=16, max_model_len=256), kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    for i, (token_ids, images) in enumerate(prompts):
        prefill.add_request(f"r{i}", token_ids, params, prefill_only=True, images=images)
    firsts = run(prefill)
    decoded = counting_decodes(monkeypatch)
    for i, (token_ids, images) in enumerate(prompts):
        first = firsts[f"r{i}"]
        states = tuple(prefill.held_state_block_ids(f"r{i}"))  # a hybrid model's
        remote = RemoteKV(f"l{i}", len(token_ids), tuple(first.kv_block_ids), "prefill-0",
                          state_block_ids=states)  # fmt: skip
        decode.add_request(f"r{i}", token_ids, params, remote_kv=remote, images=images,
                           output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    assert decoded == []  # only headers read
    outputs = run(decode)
    assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(6)] == expected
    assert (
        decode.scheduler.num_preemptions > 0
        and 0 < len(decoded) <= 2 * decode.scheduler.num_preemptions
    )
    for i in range(6):
        assert prefill.release_kv(f"r{i}")
    assert prefill.leak_report() == [] and decode.leak_report() == []


# A PNG whose header reads and whose last chunk is broken: Pillow raises SyntaxError
# (not OSError) decoding it, which escaped a decode worker's step and took it down.
BROKEN_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d494844520000001400000011080200000052261be900000013494441"
    "54789c63601805a360658c0206060600040d0001b8b83a9a000000004945a944ae426082"
)


@pytest.mark.parametrize(("bad", "said"), [("truncated", "truncated"), ("broken", "broken PNG")])
def test_an_image_undecodable_at_recompute_fails_its_request_alone(llava, bad, said):
    """A pulled prompt's images are only header-checked: one whose data is cut short (or
    broken past its header) passes. Its pull failing, the decode engine must compute the
    prompt, cannot decode the image, and fails that request as invalid input; the other
    request, and the engine, go on."""
    llm = LLM(llava)
    prompts = [request(llm, IMAGES[i : i + 2]) for i in (0, 1)]
    data = IMAGES[1][:120] if bad == "truncated" else BROKEN_PNG
    truncated = ImageInput(prompts[0][1][1].offset, data)
    puller = LocalPuller()
    prefill = LLMEngine(llava, EngineConfig())
    decode = LLMEngine(llava, EngineConfig(), kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    for i, (token_ids, images) in enumerate(prompts):
        prefill.add_request(f"r{i}", token_ids, GREEDY, prefill_only=True, images=images)
    firsts = run(prefill)
    puller.fail_next = True  # r0's pull
    for i, (token_ids, images) in enumerate(prompts):
        first = firsts[f"r{i}"]
        states = tuple(prefill.held_state_block_ids(f"r{i}"))  # a hybrid model's
        remote = RemoteKV(f"l{i}", len(token_ids), tuple(first.kv_block_ids), "prefill-0",
                          state_block_ids=states)  # fmt: skip
        sent = [images[0], truncated] if i == 0 else images
        decode.add_request(f"r{i}", token_ids, GREEDY, remote_kv=remote, images=sent,
                           output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    outputs = run(decode)
    assert outputs["r0"].error_param == "images" and said in outputs["r0"].error
    assert len(outputs["r1"].outputs[0].token_ids) == 12
    for i in range(2):
        assert prefill.release_kv(f"r{i}")
    assert prefill.leak_report() == [] and decode.leak_report() == []


def test_bad_images_are_refused_with_the_engine_unchanged(llava, tiny_llama):
    llm = LLM(llava)
    engine = llm.engine
    token_ids, images = request(llm, IMAGES[:2])

    # A request holds its images' pixels resized and cropped, as bytes, until encoded.
    prepared = engine.prepare_images(token_ids, images)
    assert [(p.pixels.dtype, tuple(p.pixels.shape)) for p in prepared] == [
        (torch.uint8, (3, 28, 28))
    ] * 2

    def refused(token_ids, images) -> str:
        with pytest.raises(InvalidRequestError) as raised:
            engine.add_request("bad", token_ids, GREEDY, images=images)
        assert raised.value.param == "images"
        return raised.value.message

    assert "not a readable image" in refused(
        token_ids, [images[0], ImageInput(images[1].offset, b"GIF89a")]
    )
    assert "are not its 1 images" in refused(token_ids, images[:1])  # a run without its image
    assert "do not match" in refused(
        token_ids, [images[0], ImageInput(images[1].offset - 1, IMAGES[1])]
    )
    assert "are not its" in refused(token_ids[:-20] + [token_ids[images[1].offset]] * 3, images)
    with pytest.raises(ValueError, match="holds 2 '<image>' markers for 1 images"):
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[:1]}}], GREEDY)
    text_only = LLMEngine(tiny_llama, EngineConfig())
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_only.add_request("x", [5, 6, 7], GREEDY, images=[ImageInput(0, IMAGES[0])])
    assert not engine.has_unfinished_requests() and engine.leak_report() == []


def test_two_ranks_give_one_ranks_tokens(llava):
    """Tensor parallelism: rank 0 encodes and broadcasts the image rows to the other rank
    before the layers run, chunked prompts included."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    num_encoded = assert_two_ranks_give_one_ranks_tokens(llava, prompts, prefill_chunk_tokens=23)
    assert num_encoded == 3  # IMAGES[1] is in both


def assert_two_ranks_give_one_ranks_tokens(
    model_dir, prompts: list[dict], prefill_chunk_tokens: int, **engine_args
) -> int:
    """``prompts`` give one rank's greedy tokens on two (chunked; ``engine_args`` too);
    returns the images the two encoded."""
    one = LLM(model_dir)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(model_dir, tensor_parallel_size=2, prefill_chunk_tokens=prefill_chunk_tokens,
             **engine_args) as two:  # fmt: skip
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
        assert two.engine.leak_report() == []
        return two.engine.runner.num_images_encoded


def test_a_siglip_tower_over_qwen2_equals_transformers(llava, tmp_path):
    """LLaVA's layout over another language model (Qwen2: q/k/v biases) with a SigLIP
    tower (no class token, every patch kept, two feature layers) and SigLIP's processor
    (a plain resize, no crop): the tokens transformers gives, pixels from its processor."""
    import json
    import shutil

    import transformers
    from PIL import Image
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    made = json.loads((llava / "config.json").read_text())
    vocab_size, image_token_id = made["text_config"]["vocab_size"], made["image_token_index"]
    torch.manual_seed(3)
    config = transformers.LlavaConfig(
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=28, patch_size=7,
        ),
        text_config=transformers.Qwen2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
            eos_token_id=made["text_config"]["eos_token_id"],
        ),
        image_token_id=image_token_id, vision_feature_select_strategy="full",
        vision_feature_layer=[-1, -3], projector_hidden_act="gelu_pytorch_tanh",
    )  # fmt: skip
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    out = tmp_path / "siglip-qwen2"
    model.save_pretrained(out)
    for path in llava.iterdir():  # the made model's tokenizer and template
        if path.name.startswith("tokenizer") or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    processing = {"image_processor_type": "SiglipImageProcessor", "do_resize": True,
                  "size": {"height": 28, "width": 28}, "resample": 3, "do_rescale": True,
                  "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3,
                  "image_std": [0.5] * 3}  # fmt: skip
    (out / "preprocessor_config.json").write_text(json.dumps(processing))
    llm = LLM(out)
    assert llm.engine.arch.architecture == "Qwen2ForCausalLM" and llm.engine.arch.qkv_bias
    images = IMAGES[:2]
    token_ids, _ = request(llm, images)
    (output,) = llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False
    )
    pixels = SiglipImageProcessorPil(**processing)(
        images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt"
    )["pixel_values"]
    with torch.no_grad():
        expected = model.generate(input_ids=torch.tensor([token_ids]), pixel_values=pixels,
                                  max_new_tokens=12, do_sample=False)  # fmt: skip
    assert output.outputs[0].token_ids == expected[0, len(token_ids) :].tolist()
    assert llm.engine.leak_report() == []


def test_llm_chat_takes_image_parts_through_either_kind_of_template(llava, tmp_path):
    """``LLM.chat``: OpenAI-style messages with a data: URL part and a PIL image part give
    ``generate``'s tokens on the template's text, with the made template (it reads parts)
    and with a copy whose ChatML template reads strings; http URLs are refused."""
    import base64
    import shutil

    from PIL import Image

    from engine.models.tokenizer_trainer import CHAT_TEMPLATE

    url = "data:image/png;base64," + base64.b64encode(IMAGES[0]).decode()
    conversation = [{"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " and how does it differ from "},
        {"type": "image", "image": Image.open(io.BytesIO(IMAGES[1]))},
        {"type": "text", "text": "?"},
    ]}]  # fmt: skip
    plain = tmp_path / "plain"
    shutil.copytree(llava, plain)
    (plain / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    got = []
    for model in (llava, plain):
        llm = LLM(model)
        ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGES[:2]}}
        (expected,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        (output,) = llm.chat(conversation, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        got.append(output.outputs[0].token_ids)
        assert llm.engine.leak_report() == []
    assert got[0] == got[1]
    web = [{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/y.png"}]}]
    with pytest.raises(ValueError, match="data: URL"):
        llm.chat(web, GREEDY)


def test_the_engines_block_hashes_are_the_routers(llava):
    """The prefix-cache hashes the engine gives an image prompt's blocks (what its KV
    events carry) equal ``hash_blocks`` over the router's spans (``router.images``), and
    differ from the text-only hashes exactly from the first block an image touches."""
    from common.hashing import hash_blocks
    from common.multimodal import ImageSpan, image_digest
    from proto import pdserve_pb2 as pb
    from router.images import place_images

    llm = LLM(llava, block_size=8)
    vision = llm.engine.arch.vision
    expanded = llm._image_text().expand(PROMPT, [16, 16])
    raw = llm.tokenizer.encode(expanded, add_special_tokens=False)
    token_ids, placed = place_images(raw, IMAGES[:2], vision, [16, 16])
    engine_request = llm.engine.add_request(
        "r", token_ids, GREEDY, images=[ImageInput(m.offset, m.data) for m in placed.messages]
    )
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert engine_request.image_spans == placed.spans
    full = len(token_ids) // 8
    assert engine_request.block_hashes[:full] == hash_blocks(token_ids, 8, images=placed.spans)
    plain = hash_blocks(token_ids, 8)
    first_touched = placed.spans[0].offset // 8
    assert engine_request.block_hashes[:first_touched] == plain[:first_touched]
    assert all(a != b for a, b in zip(engine_request.block_hashes[first_touched:full],
                                      plain[first_touched:full], strict=True))  # fmt: skip
    assert isinstance(placed.messages[0], pb.Image)
    assert placed.spans[0] == ImageSpan(placed.spans[0].offset, 16, image_digest(IMAGES[0]))
    assert llm.engine.leak_report() == []
