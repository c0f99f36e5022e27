"""Speculative decoding through a real ``pdserve up`` stack (router + 1 prefill + 1 decode
worker, ``decode.engine.num_speculative_tokens: 4``): every request is disaggregated, the
decode worker verifies n-gram drafts, and the client gets exactly the tokens of the
offline engine without speculation, whole or streamed, with stop strings cut where they
would be. A few allowed tokens make the random model repeat itself, so drafts are kept."""

from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from tests.support.processes import write_config
from tests.support.stack import metric, serving, worker_stats

MODEL = "speculating"
PROMPTS = ["def add(a, b):\n    return a + b\n", "The list goes on: one, two, three,"]
ALLOWED = list(range(60, 66))


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speculative")
    config = write_config(
        tmp / "config.yaml",
        tiny_llama,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0},
        decode={"engine": {"num_speculative_tokens": 4}},
    )
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return stack.openai_client()


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(tiny_llama)


def _ask(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0.0,
            "extra_body": {"allowed_token_ids": ALLOWED, "ignore_eos": True,
                           "return_token_ids": True}, **extra}  # fmt: skip


def _expected(offline: LLM, prompt: str, temperature: float, seed: int | None) -> list[int]:
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=seed,
                            allowed_token_ids=ALLOWED, ignore_eos=True)  # fmt: skip
    (output,) = offline.generate([prompt], params, use_tqdm=False)
    return output.outputs[0].token_ids


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 17)])
def test_tokens_equal_the_engine_without_drafts(client, offline, stack, temperature, seed):
    before = worker_stats(stack, "decode")[0].accepted_draft_tokens
    for prompt in PROMPTS:
        expected = _expected(offline, prompt, temperature, seed)
        ask = _ask(prompt, temperature=temperature, seed=seed)
        whole = client.completions.create(**ask).choices[0]
        assert whole.model_extra["token_ids"] == expected
        assert whole.finish_reason == "length"
        streamed_ids, streamed_text = [], ""
        for chunk in client.completions.create(**ask, stream=True):
            for choice in chunk.choices:
                streamed_ids += choice.model_extra.get("token_ids") or []
                streamed_text += choice.text
        assert streamed_ids == expected and streamed_text == whole.text
    stats = worker_stats(stack, "decode")[0]
    assert stats.accepted_draft_tokens > before  # drafts were kept, not just tried
    assert 0 < stats.accepted_draft_tokens <= stats.draft_tokens


def test_a_stop_string_inside_kept_drafts_cuts_where_it_would(client, offline):
    prompt = PROMPTS[0]
    text = offline.tokenizer.decode(_expected(offline, prompt, 0.0, None))
    stop = text[20:23]
    whole = client.completions.create(**_ask(prompt, stop=[stop])).choices[0]
    assert whole.text == text[: text.index(stop)]
    assert whole.finish_reason == "stop"
    streamed = "".join(
        choice.text
        for chunk in client.completions.create(**_ask(prompt, stop=[stop]), stream=True)
        for choice in chunk.choices
    )
    assert streamed == whole.text


def test_the_router_shows_the_acceptance(client, stack):
    client.completions.create(**_ask(PROMPTS[1]))
    drafted = metric(stack, "pdserve:worker_draft_tokens")
    accepted = metric(stack, "pdserve:worker_accepted_draft_tokens")
    assert 0 < accepted <= drafted
