"""Greedy tokens equal transformers' on the same weights, for every supported architecture."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.engine.helpers import hf_greedy, random_prompts

NUM_TOKENS = 32


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_transformers(model_factory, arch):
    model_dir = model_factory(arch)
    prompts = random_prompts()
    llm = LLM(model_dir, dtype="float32")  # float32 on a GPU too: parity is exact
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # Nemotron-H: transformers' incremental decode skips the time-step clamp its forward
    # pass applies (the engine clamps every token: ``mamba2.py``); without a cache every
    # step is that forward pass.
    expected = hf_greedy(model_dir, prompts, NUM_TOKENS, use_cache=not arch.startswith("nemotron"))
    for prompt, output, reference in zip(prompts, outputs, expected, strict=True):
        assert output.outputs[0].token_ids == reference, f"prompt of {len(prompt)} tokens"
        assert output.outputs[0].finish_reason == "length"
    assert llm.engine.leak_report() == []
