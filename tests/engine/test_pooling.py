"""Embeddings: the last token's hidden state equals transformers' on the same weights, and
chunking, prefix-cache hits and batching with generation change neither it nor the
generated tokens."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from common.engine_config import EngineConfig
from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.models.arch import ModelLoadError
from engine.pooling import EMBEDDING_SAMPLING
from tests.engine.helpers import headless_copy, hf_last_logits, random_prompts

LENGTHS = (1, 5, 17, 33, 64, 100)  # one token; within a block; several blocks; exactly 4


def hf_last_hidden(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last-layer hidden state (after the final norm) at each prompt's last
    token, one prompt at a time."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1] for prompt in prompts
        ]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen2_moe"])
def test_embeddings_equal_transformers_last_hidden_state(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts(LENGTHS, seed=3)
    llm = LLM(model_dir, dtype="float32")
    normalized = llm.embed(prompts, use_tqdm=False)
    raw = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    for prompt, unit, plain, expected in zip(
        prompts, normalized, raw, hf_last_hidden(model_dir, prompts), strict=True
    ):
        assert plain.finished and plain.outputs[0].token_ids == []
        torch.testing.assert_close(plain.embedding, expected, atol=1e-4, rtol=1e-4)
        vector = unit.embedding
        assert vector.norm().item() == pytest.approx(1.0, abs=1e-5), len(prompt)
        torch.testing.assert_close(vector, expected / expected.norm(), atol=1e-5, rtol=1e-4)
    assert llm.engine.leak_report() == []


# gemma3: its logits are soft-capped; phi3: tied to nothing, a fused projection.
@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_token_logits_equal_transformers_next_token_logits(model_factory, arch):
    """``PoolingParams(token_ids=...)``: the last token's logits at those ids, in their
    order (a reranker's "no"/"yes"), as transformers computes them; beside hidden-state
    embeddings and generation in one batch."""
    model_dir = model_factory(arch)
    prompts = random_prompts(LENGTHS, seed=4)
    token_ids = [(9, 2), (31,), (5, 5, 100, 0), (7, 3), (64, 1), (2, 9)]
    expected = hf_last_logits(model_dir, prompts)
    llm = LLM(model_dir, dtype="float32")
    engine = llm.engine
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0)
    generated = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (prompt, ids) in enumerate(zip(prompts, token_ids, strict=True)):
        engine.add_request(f"score-{i}", prompt, EMBEDDING_SAMPLING,
                           pooling=PoolingParams(token_ids=ids))  # fmt: skip
        engine.add_request(f"embed-{i}", prompt, EMBEDDING_SAMPLING, pooling=PoolingParams())
        engine.add_request(f"gen-{i}", prompt, params)
    # And a step's other logits passes before the pooled one: a prompt scored.
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    engine.add_request("scored", prompts[3], scoring)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    for i, (ids, logits) in enumerate(zip(token_ids, expected, strict=True)):
        vector = finished[f"score-{i}"].embedding
        assert vector.dtype == torch.float32 and vector.shape == (len(ids),)
        torch.testing.assert_close(vector, logits[list(ids)], atol=1e-4, rtol=1e-4)
        assert finished[f"embed-{i}"].embedding.shape == (engine.arch.hidden_size,)
        assert finished[f"gen-{i}"].outputs[0].token_ids == generated[i]
    alone = llm.generate([prompts[3]], scoring, use_tqdm=False)[0].prompt_logprobs
    assert finished["scored"].prompt_logprobs == alone
    assert engine.leak_report() == []


def test_token_logits_need_a_head_and_ids_in_the_vocabulary(model_factory, tmp_path):
    bare = LLMEngine(headless_copy(model_factory("qwen3"), tmp_path / "bare"),
                     EngineConfig().replace(dtype="float32"))  # fmt: skip
    full = LLMEngine(model_factory("qwen3"), EngineConfig().replace(dtype="float32"))
    vocab_size = full.arch.vocab_size
    for engine, ids, words in (
        (bare, (1, 2), "no language-model head"),
        (full, (1, vocab_size), f"[0, {vocab_size})"),
        (full, (-1,), f"[0, {vocab_size})"),
    ):
        with pytest.raises(InvalidRequestError, match=re.escape(words)) as raised:
            pooling = PoolingParams(token_ids=ids)
            engine.add_request("s", [5, 6], EMBEDDING_SAMPLING, pooling=pooling)
        assert raised.value.param == "pooling"
        assert engine.leak_report() == [] and not engine.has_unfinished_requests()


def test_chunks_cache_hits_and_generation_beside_change_nothing(tiny_llama):
    """An embedding computed in 16-token chunks, one taken whole from the prefix cache,
    and ones batched with generating requests: the same vectors, and the generating
    requests' tokens those of a run without embeddings."""
    prompts = random_prompts((40, 100, 130), seed=5)
    whole = LLM(tiny_llama, dtype="float32")
    expected = [o.embedding for o in whole.embed(prompts, use_tqdm=False)]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    generated = [o.outputs[0].token_ids for o in whole.generate(prompts, params, use_tqdm=False)]

    engine = LLMEngine(tiny_llama, whole.engine.config.replace(prefill_chunk_tokens=16))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen-{i}", prompt, params)
        engine.add_request(f"embed-{i}", prompt, EMBEDDING_SAMPLING, pooling=PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    # Again, now that the prompts are cached: only the last token is computed.
    for i, prompt in enumerate(prompts):
        engine.add_request(f"again-{i}", prompt, EMBEDDING_SAMPLING, pooling=PoolingParams())
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    for i, prompt in enumerate(prompts):
        assert finished[f"gen-{i}"].outputs[0].token_ids == generated[i]
        for name in ("embed", "again"):
            vector = finished[f"{name}-{i}"].embedding
            torch.testing.assert_close(vector, expected[i], atol=1e-5, rtol=1e-4)
        cached = finished[f"again-{i}"].num_cached_tokens
        assert cached == (len(prompt) - 1) // 16 * 16, (len(prompt), cached)
    assert engine.leak_report() == []


def test_embedding_requests_never_speculate_or_sample(tiny_llama):
    """A one-token prompt looks like a decoding request to the draft proposer; it must be
    pooled, not verified. Sampling params other than EMBEDDING_SAMPLING, or the
    disaggregated roles' fields, are refused with the engine unchanged."""
    llm = LLM(tiny_llama, dtype="float32", num_speculative_tokens=4)
    outputs = llm.embed([[7], [7, 8, 7, 8, 7, 8, 7]], use_tqdm=False)
    assert all(o.embedding.shape == (llm.engine.arch.hidden_size,) for o in outputs)
    engine = llm.engine
    for kwargs in (
        {"params": SamplingParams(max_tokens=1, temperature=0.5)},
        {"prefill_only": True},
        {"output_token_ids": [3]},
    ):
        params = kwargs.pop("params", EMBEDDING_SAMPLING)
        with pytest.raises(InvalidRequestError) as raised:
            engine.add_request("bad", [5, 6, 7], params, pooling=PoolingParams(), **kwargs)
        assert raised.value.param == "pooling"
    assert engine.leak_report() == [] and not engine.has_unfinished_requests()


def test_an_aborted_embedding_request_leaves_nothing(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig().replace(dtype="float32", prefill_chunk_tokens=16))
    engine.add_request("e", random_prompts((90,))[0], EMBEDDING_SAMPLING, pooling=PoolingParams())
    engine.step()  # one chunk of six
    output = engine.abort_request("e")
    assert output is not None and output.finished and output.embedding is None
    assert engine.leak_report() == []


def test_a_headless_checkpoint_serves_embeddings_only(model_factory, tmp_path):
    """A backbone saved alone loads (bare names mapped under ``model.``) and gives the
    full checkpoint's embeddings, which are transformers' too; generating with it, which
    has no head, is invalid input naming the model."""
    model_dir = model_factory("qwen3")
    bare = headless_copy(model_dir, tmp_path / "bare")
    prompts = random_prompts((9, 40), seed=7)
    full = LLM(model_dir, dtype="float32").embed(prompts, use_tqdm=False)
    llm = LLM(bare, dtype="float32")
    outputs = llm.embed(prompts, use_tqdm=False)
    for output, reference, expected in zip(
        outputs, full, hf_last_hidden(bare, prompts), strict=True
    ):
        assert torch.equal(output.embedding, reference.embedding)
        vector = output.embedding
        torch.testing.assert_close(vector, expected / expected.norm(), atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError) as raised:
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert raised.value.param == "model" and "embeddings only" in raised.value.message
    assert llm.engine.leak_report() == [] and not llm.engine.has_unfinished_requests()
    # A causal LM's files (names under "model.") without their head are broken instead.
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        LLM(broken, dtype="float32")
