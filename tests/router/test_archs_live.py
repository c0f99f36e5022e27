"""Architectures beyond Llama served disaggregated by a real ``pdserve up`` stack (router +
1 prefill + 1 decode worker): a mixture-of-experts model (Qwen2-MoE: routed experts plus a
gated shared expert) and GPT-OSS (attention sinks, biased experts, windows on every other
layer). The prompt's KV moves to the decode worker, which continues it, and the client gets
exactly the offline engine's tokens, greedy and seeded, whole and streamed. (Gemma 3 and
Phi-3 differ from these only inside the engine: their parity is tested offline.)"""

from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "served"
# The first prompt runs past GPT-OSS's 64-token window (the maker's).
PROMPTS = ["def add(a, b):\n    return a + b\n" * 8, "Mixture of experts routes each token"]
NUM_TOKENS = 24


@pytest.fixture(scope="module", params=["qwen2_moe", "gpt_oss"])
def model_dir(request, model_factory):
    return model_factory(request.param)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arch")
    config = write_config(
        tmp / "config.yaml",
        model_dir,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0},
    )
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(model_dir)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 17)])
def test_disaggregated_tokens_equal_the_offline_engine(stack, offline, temperature, seed):
    client: openai.OpenAI = stack.openai_client()
    pulled_before = worker_stats(stack, "decode")[0].blocks_pulled
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=temperature, seed=seed,
                            ignore_eos=True)  # fmt: skip
    for prompt in PROMPTS:
        (reference,) = offline.generate([prompt], params, use_tqdm=False)
        expected = reference.outputs[0].token_ids
        ask = {"model": MODEL, "prompt": prompt, "max_tokens": NUM_TOKENS,
               "temperature": temperature, "seed": seed,
               "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
        whole = client.completions.create(**ask).choices[0]
        assert whole.model_extra["token_ids"] == expected
        assert whole.text == reference.outputs[0].text
        streamed: list[int] = []
        for chunk in client.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                streamed += choice.model_extra.get("token_ids") or []
        assert streamed == expected
    # The decode worker pulled the prompts' KV: the requests really were split.
    assert worker_stats(stack, "decode")[0].blocks_pulled > pulled_before
