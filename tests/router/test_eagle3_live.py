"""An EAGLE-3 head through a real ``pdserve up`` stack (router + 1 prefill + 1 decode
worker, ``engine.speculative_method: eagle3``, the oracle head over a bigram target):
every request is disaggregated, the head's KV of the prompt moves with its blocks through
the connector, the decode worker keeps every draft, and the client gets exactly the
tokens of the offline engine without drafts, whole or streamed."""

from __future__ import annotations

import pytest

from benchmarks.draft_model import bigram_checkpoint
from benchmarks.eagle3 import oracle_eagle3_head
from engine import LLM, SamplingParams
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "eagle"
PROMPTS = ["Once upon a time, in a land far away,", "def fib(n):\n    if n < 2:\n"]


@pytest.fixture(scope="module")
def target_and_stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3")
    target = bigram_checkpoint(tiny_llama, tmp / "target")
    head = oracle_eagle3_head(target, tmp / "head")
    config = write_config(
        tmp / "config.yaml",
        target,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0},
        engine={"speculative_method": "eagle3", "draft_model": str(head),
                "num_speculative_tokens": 3},
    )  # fmt: skip
    with serving(config, tmp / "home") as stack:
        yield target, stack


def test_every_draft_is_kept_and_the_tokens_are_the_engines(target_and_stack):
    target, stack = target_and_stack
    client = stack.openai_client()
    offline = LLM(target)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        (expected,) = offline.generate([prompt], params, use_tqdm=False)
        ask = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0.0,
               "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
        whole = client.completions.create(**ask).choices[0]
        assert whole.model_extra["token_ids"] == expected.outputs[0].token_ids
        streamed = []
        for chunk in client.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                streamed += choice.model_extra.get("token_ids") or []
        assert streamed == expected.outputs[0].token_ids
    stats = worker_stats(stack, "decode")[0]
    # 4 requests of 29 decoded tokens, up to 4 a step: drafts right from the first step.
    assert stats.draft_tokens == stats.accepted_draft_tokens >= 4 * 20
