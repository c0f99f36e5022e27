"""A draft model through a real ``pdserve up`` stack (router + 1 prefill + 1 decode worker,
``engine.speculative_method: draft_model``, the target as its own draft): every request is
disaggregated, the prefill worker's first drafts go with its token, the decode worker
reads the prompt into its draft and keeps every draft, and the client gets exactly the
tokens of the offline engine without drafts, whole or streamed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "drafting"
PROMPTS = ["Once upon a time, in a land far away,", "def fib(n):\n    if n < 2:\n"]


@contextmanager
def drafting_stack(tmp: Path, target: Path, method: str, draft: Path, model: str) -> Iterator:
    """A 1P1D ``pdserve up`` stack serving ``target`` as ``model``, drafting 3 tokens a
    step with ``method`` from ``draft``; every request disaggregated."""
    config = write_config(
        tmp / "config.yaml",
        target,
        router={"served_model_name": model, "min_disagg_tokens": 0},
        engine={"speculative_method": method, "draft_model": str(draft),
                "num_speculative_tokens": 3},
    )  # fmt: skip
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("draft-model")
    with drafting_stack(tmp, tiny_llama, "draft_model", tiny_llama, MODEL) as stack:
        yield stack


def test_every_draft_is_kept_and_the_tokens_are_the_engines(stack, tiny_llama):
    assert_drafts_kept_and_tokens_offline(stack, MODEL, LLM(tiny_llama))


def assert_drafts_kept_and_tokens_offline(stack, model: str, offline: LLM) -> None:
    """Each of ``PROMPTS``, whole and streamed, gets the tokens of ``offline`` (the engine
    without drafts), and the decode worker kept every draft it verified."""
    client = stack.openai_client()
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        (expected,) = offline.generate([prompt], params, use_tqdm=False)
        ask = {"model": model, "prompt": prompt, "max_tokens": 30, "temperature": 0.0,
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
