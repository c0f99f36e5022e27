"""Qwen2.5-VL's and Qwen3-VL's layouts in the engine: images at their own resolution
(each its own token count), their vision transformers (Qwen2.5-VL's windowed, Qwen3-VL's
with learned positions and DeepStack rows for the first layers), and 3-D rotary positions
(M-RoPE: sections, or Qwen3-VL's interleaved pairs) in the language model: transformers'
positions, tokens and log-probs, whatever the chunking, caching, speculation, preemption,
resumption, disaggregation or tensor parallelism. Qwen3-VL-MoE: its parity, and its
stacked experts in the released and in transformers 5's layout, over 2 expert ranks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.mrope import mrope_positions
from tests.engine.helpers import save_plain_target_adapter
from tests.engine.test_images import (
    assert_preemption_and_resumption_keep_tokens,
    assert_two_ranks_give_one_ranks_tokens,
    colocated_tokens,
    disaggregated_pair,
    png,
    pulled_tokens,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = (
    f"<|im_start|>user\nCompare {IMAGE} with {IMAGE}, please.<|im_end|>\n<|im_start|>assistant\n"
)
# (height, width) -> token grids 2 x 3; 7 x 4 (Qwen2.5-VL: a window and a part), 6 x 4
# (Qwen3-VL: more patches than its position table's side down, fewer across); 8 x 8 (max
# pixels).
IMAGES = [png(1, 60, 90), png(2, 200, 120), png(3, 300, 300)]
NUM_IMAGE_TOKENS = {
    "qwen2_5_vl": 6 + 28,
    "qwen3_vl": 6 + 24,
    "qwen3_vl_moe": 6 + 24,
    "qwen3_5_mm": 6 + 24,
}  # of IMAGES[:2]
GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen_vl(model_factory, request):
    return model_factory(request.param)


def hf_reference(model_dir, token_ids: list[int], images: list[bytes], mrope: bool = True):
    """transformers' greedy tokens (12) and prompt log-probs, pixels from its processor;
    ``mrope`` False: the prompt log-probs at 1-D positions (given), and no tokens."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    pixels = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    ids = torch.tensor([token_ids])
    inputs = {"input_ids": ids, **pixels}
    inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    if not mrope:
        with torch.no_grad():
            logits = model(**inputs, position_ids=torch.arange(len(token_ids))[None]).logits[0]
        return [], logits[:-1].float().log_softmax(-1)
    with torch.no_grad():
        logits = model(**inputs).logits[0]
        tokens = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tokens[0, len(token_ids) :].tolist(), logits[:-1].float().log_softmax(-1)


def request(llm: LLM, images: list[bytes], prompt: str = PROMPT):
    return llm._with_images({"prompt": prompt, "multi_modal_data": {"image": images}})


def test_positions_equal_transformers(qwen_vl):
    """``mrope_positions`` against ``get_rope_index``: images first, last, alone, between
    text, of several grids; the delta that later tokens add."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(qwen_vl, dtype=torch.float32)
    image_id = model.config.image_token_id
    layouts = [  # (text before, (rows, columns)), ..., text after
        ([(0, (2, 3))], 5), ([(4, (7, 4))], 0), ([(0, (1, 1))], 0),
        ([(3, (2, 3)), (2, (8, 8)), (1, (3, 2))], 4),
    ]  # fmt: skip
    for images, tail in layouts:
        ids, grids = [], []
        for before, (rows, columns) in images:
            ids += [5] * before
            grids.append((len(ids), rows, columns))
            ids += [image_id] * rows * columns
        ids += [5] * tail
        thw = torch.tensor([[1, 2 * rows, 2 * columns] for _, rows, columns in grids])
        input_ids = torch.tensor([ids])
        expected, delta = model.model.get_rope_index(
            input_ids, mm_token_type_ids=(input_ids == image_id).int(), image_grid_thw=thw
        )
        got = mrope_positions(len(ids), grids)
        assert np.array_equal(got.prompt, expected[:, 0].numpy()), images
        assert got.delta == delta.item()
        assert np.array_equal(got.rows(len(ids), len(ids) + 2)[1], len(ids) + delta.item()
                              + np.arange(2))  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_mm"])
def test_tokens_and_prompt_logprobs_equal_transformers(model_factory, arch):
    """Two images of their own sizes (6 and 28 or 24 tokens), both orders: the ids
    transformers' processor writes, its greedy tokens, and every prompt log-prob within
    1e-4. With 1-D positions (M-RoPE left out) the log-probs are off by far more."""
    qwen_vl = model_factory(arch)
    llm = LLM(qwen_vl)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, prompt_logprobs=1)
    replies = []
    for images in (IMAGES[:2], IMAGES[1::-1]):
        token_ids, _ = request(llm, images)
        image_id = llm.engine.arch.vision.image_token_id
        assert token_ids.count(image_id) == NUM_IMAGE_TOKENS[arch]
        (output,) = llm.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": images}}], params, use_tqdm=False
        )
        expected_tokens, expected_logprobs = hf_reference(qwen_vl, token_ids, images)
        assert output.outputs[0].token_ids == expected_tokens
        got = torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]])
        rows, targets = torch.arange(len(got)), torch.tensor(token_ids[1:])
        assert torch.allclose(got, expected_logprobs[rows, targets], atol=1e-4)
        replies.append(got[-8:])  # the text after both images: the same tokens either way
    _, flat = hf_reference(qwen_vl, token_ids, IMAGES[1::-1], mrope=False)
    assert (got - flat[rows, targets]).abs().max() > 1e-2
    assert (replies[0] - replies[1]).abs().max() > 1e-3  # the images' order matters
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunks_prefix_cache_and_speculation_keep_the_tokens(qwen_vl, chunk):
    """Chunked prompts (chunks cut images anywhere: attention stays causal), the same
    images again (prefix hits inside and after images: their positions are the prompt's,
    not the sequence's), and n-gram speculation (drafts verified at shifted positions)."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    whole = LLM(qwen_vl, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(qwen_vl, prefill_chunk_tokens=chunk, block_size=8, num_speculative_tokens=3)
    for _ in range(2):  # the second round hits the first's blocks
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
    assert llm.engine.scheduler.kv.num_hit_tokens > 0
    assert llm.engine.leak_report() == []


def test_preempted_and_resumed_requests_keep_their_positions(qwen_vl):
    """Requests preempted by a small KV pool recompute their prompts; sequences resumed
    from their first 7 tokens (a migration) continue at the prompt's shifted positions."""
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": [png(30 + i), IMAGES[i % 3]]}}
        for i in range(4)
    ]
    assert_preemption_and_resumption_keep_tokens(qwen_vl, prompts, num_blocks=24)


def test_disaggregated_equals_colocated(qwen_vl):
    """The decode engine reads its pulled requests' image sizes from their headers alone
    (undecoded) for the positions of the tokens it generates; a failed pull recomputes."""
    llm = LLM(qwen_vl)
    prompts = [request(llm, IMAGES[i : i + 2]) for i in (0, 1)]
    expected = colocated_tokens(qwen_vl, prompts)
    prefill, decode, puller = disaggregated_pair(qwen_vl)
    for fail in (True, False):
        assert pulled_tokens(prefill, decode, puller, prompts, fail) == expected, fail
    for engine in (prefill, decode):
        assert engine.leak_report() == []


def test_two_ranks_give_one_ranks_tokens(qwen_vl):
    """Tensor parallelism: the other rank gets the step's 3-D positions with its rows."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    assert_two_ranks_give_one_ranks_tokens(qwen_vl, prompts, prefill_chunk_tokens=7)


def test_sizes_it_cannot_serve_are_refused(qwen_vl):
    llm = LLM(qwen_vl)
    with pytest.raises(ValueError, match="aspect ratio"):
        request(llm, [png(9, 2, 500), IMAGES[0]])
    assert llm.engine.leak_report() == []


def test_qwen3_vl_moe_experts_load_in_either_layout(model_factory, tmp_path):
    """Qwen3-VL-MoE's stacked experts as released (input-major, the made model's) and as
    transformers 5 saves them (output-major) give the same tokens; expert parallelism over
    2 ranks gives one rank's; a stack of the wrong shape is refused, named."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from engine.models.errors import ModelLoadError

    released = model_factory("qwen3_vl_moe")
    resaved = tmp_path / "resaved"
    shutil.copytree(released, resaved)
    AutoModelForImageTextToText.from_pretrained(released).save_pretrained(resaved)
    stacks = load_file(resaved / "model.safetensors")
    name = "model.language_model.layers.0.mlp.experts.down_proj"  # [E, I, H] as released
    assert load_file(released / "model.safetensors")[name].shape == (8, 192, 256)
    assert stacks[name].shape == (8, 256, 192)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    replies = []
    for model_dir in (released, resaved):
        outputs = LLM(model_dir).generate(prompts, GREEDY, use_tqdm=False)
        replies.append([o.outputs[0].token_ids for o in outputs])
    assert replies[0] == replies[1]
    assert_two_ranks_give_one_ranks_tokens(released, prompts, 7, expert_parallel=True)
    stacks[name] = stacks[name][:, :-1].contiguous()
    save_file(stacks, resaved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj is \\[8, 255, 192\\]"):
        LLM(resaved)


def test_a_peft_adapter_that_wraps_the_tower_serves_the_language_model(
    model_factory, tmp_path, caplog
):
    """PEFT's plain targets (``down_proj``) wrap Qwen2.5-VL's vision blocks too
    (``model.visual.blocks.*.mlp.down_proj``): the adapter loads, its vision tensors left
    out and logged, and text prompts under it decode what transformers + peft decode."""
    import peft
    from transformers import AutoModelForImageTextToText

    def hf_greedy(model_dir, prompts, num_tokens, adapter_dir=None) -> list[list[int]]:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), max_new_tokens=num_tokens, do_sample=False,
                                   min_new_tokens=num_tokens)[0, len(p) :].tolist()
                    for p in prompts]  # fmt: skip

    model_dir = model_factory("qwen2_5_vl")
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    save_plain_target_adapter(base, tmp_path / "adapter")
    llm = LLM(model_dir, lora_adapters={"tuned": tmp_path / "adapter"})
    assert "vision-tower tensors left out" in caplog.text
    prompts = [[5, 17, 300, 42, 9], [11, 12, 13]]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_name="tuned")  # fmt: skip
    tuned = [o.outputs[0].token_ids for o in outputs]
    assert tuned == hf_greedy(model_dir, prompts, 8, adapter_dir=tmp_path / "adapter")
    assert tuned != hf_greedy(model_dir, prompts, 8)
    # With images, PEFT applies the tower's tensors, which are not applied here: refused
    # (it decoded the base tower's image rows, differing from PEFT's, with a log line).
    with pytest.raises(InvalidRequestError, match="adapts the vision tower"):
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[:2]}}], params,
                     use_tqdm=False, lora_name="tuned")  # fmt: skip
    assert llm.engine.leak_report() == []


def test_qwen3_5_images_chunked_preempted_and_disaggregated(model_factory):
    """Qwen3.5's hybrid language model with images: prompts chunked anywhere in an image
    (its rows, and each linear-attention layer's states, carried across chunks),
    preempted and resumed, and disaggregated (the states pulled with the prompt's
    blocks; a failed pull recomputes): the colocated tokens."""
    model_dir = model_factory("qwen3_5_mm")
    llm = LLM(model_dir)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[i : i + 2]}} for i in (0, 1)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    chunked = LLM(model_dir, prefill_chunk_tokens=5)
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    many = [
        {"prompt": PROMPT, "multi_modal_data": {"image": [png(30 + i), IMAGES[i % 3]]}}
        for i in range(4)
    ]
    assert_preemption_and_resumption_keep_tokens(model_dir, many, num_blocks=24)
    pulled = [request(llm, IMAGES[i : i + 2]) for i in (0, 1)]
    prefill, decode, puller = disaggregated_pair(model_dir)
    colocated = colocated_tokens(model_dir, pulled)
    for fail in (True, False):
        assert pulled_tokens(prefill, decode, puller, pulled, fail) == colocated, fail
    assert decode.num_pull_failures == 1
    for engine in (prefill, decode):
        assert engine.leak_report() == []
