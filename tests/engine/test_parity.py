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
    if arch.startswith("nemotron"):
        # transformers' incremental decode skips the time-step clamp its forward pass
        # applies (the engine clamps every token: ``mamba2.py``): the forward pass over
        # each prompt and the engine's tokens must pick each of those tokens.
        expected = forward_greedy(model_dir, prompts, [o.outputs[0].token_ids for o in outputs])
    else:
        expected = hf_greedy(model_dir, prompts, NUM_TOKENS)
    for prompt, output, reference in zip(prompts, outputs, expected, strict=True):
        assert output.outputs[0].token_ids == reference, f"prompt of {len(prompt)} tokens"
        assert output.outputs[0].finish_reason == "length"
    assert llm.engine.leak_report() == []


def forward_greedy(
    model_dir, prompts: list[list[int]], generated: list[list[int]]
) -> list[list[int]]:
    """The tokens transformers' greedy decode without a cache picks after each prompt, EOS
    banned, checked in one forward pass per prompt: at each position of the prompt and
    the ``generated`` tokens, the argmax. Equal to ``generated`` exactly when greedy
    decoding with full forward passes (``generate(use_cache=False)``, 32 of them) gives
    those tokens, since each position sees only the tokens before it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    picked = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated, strict=True):
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
            logits[:, eos if isinstance(eos, list) else [eos]] = float("-inf")
            picked.append(logits.argmax(-1).tolist())
    return picked
