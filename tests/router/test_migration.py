"""Decode migration against a real ``pdserve up`` stack (router + 1 prefill + 2 decode
workers): a decode worker SIGKILLed while it streams a sequence (an OOM kill, a lost
node) costs the client nothing. The router hands the prompt and the tokens sent so far to
the other decode worker, which recomputes their KV and goes on; greedy and seeded
sequences end with exactly the tokens an undisturbed run gives, streamed or not, and
nothing is left held on any worker afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import random_prompts
from tests.support.otlp_receiver import Receiver, otlp_receiver
from tests.support.processes import write_config
from tests.support.stack import get_json, metric, serving, worker_stats

MODEL = "tiny"
NUM_TOKENS = 400  # long enough that a kill lands mid-stream on a busy CI machine
NUM_WORKERS = 3  # the stack's 1 prefill and 2 decode workers


@pytest.fixture(scope="module")
def traces() -> Iterator[Receiver]:
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory, traces):
    tmp = tmp_path_factory.mktemp("migration")
    config = write_config(
        tmp / "config.yaml",
        tiny_llama,
        num_decode=2,
        tracing={"otlp_traces_endpoint": traces.url},
        router={
            "served_model_name": MODEL,
            "min_disagg_tokens": 0,
            "refresh_interval_s": 0.3,
            "worker_stall_timeout_s": 2.0,
        },
    )
    with serving(config, tmp / "home") as stack:  # restarts the killed worker
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return stack.openai_client()


def kill_the_busy_decode_worker(stack, after_s: float = 0.0) -> str:
    """SIGKILL the decode worker running a sequence, ``after_s`` after it began; its
    name."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for index, stats in enumerate(worker_stats(stack, "decode")):
            if stats.num_running:
                time.sleep(after_s)
                os.kill(stack.children()[f"decode-{index}"], signal.SIGKILL)
                return f"decode-{index}"
        time.sleep(0.02)
    raise AssertionError("no decode worker ever ran the sequence")


def migrations(stack) -> float:
    return metric(stack, "pdserve:decode_migrations_total")


def wait_all_serving(stack) -> None:
    """Both decode workers answer again (the launcher restarted the killed one) and the
    router routes (it saw them)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            worker_stats(stack, "decode")
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, stack.log()
            time.sleep(0.3)
    while get_json(f"{stack.base_url}/health")[0] != 200:
        assert time.monotonic() < deadline, stack.log()
        time.sleep(0.3)
    # The router places work on every worker again (its pool probed the restarted one).
    while metric(stack, "pdserve:worker_available") < NUM_WORKERS:
        assert time.monotonic() < deadline, stack.log()
        time.sleep(0.1)


def offline(model, prompt: list[int], params: SamplingParams) -> list[int]:
    [output] = LLM(model).generate([prompt], params, use_tqdm=False)
    return output.outputs[0].token_ids


def test_a_stream_survives_its_decode_worker_being_killed(stack, client, tiny_llama, traces):
    """Greedy, streamed, disaggregated: killed after 20 tokens reached the client. Its
    trace shows a request that succeeded, the survivor's decode under the router's span
    (the killed worker's span died with it)."""
    prompt = random_prompts((48,), seed=91)[0]
    expected = offline(tiny_llama, prompt, SamplingParams(
        max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0))  # fmt: skip
    before = migrations(stack)
    trace_id = os.urandom(16).hex()
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, stream=True,
        extra_body={"min_tokens": NUM_TOKENS, "return_token_ids": True},
        extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
    )  # fmt: skip
    tokens: list[int] = []
    finish = None
    killed = None
    for chunk in stream:
        tokens += chunk.choices[0].model_extra.get("token_ids") or []
        finish = chunk.choices[0].finish_reason or finish
        if killed is None and len(tokens) >= 20:
            killed = kill_the_busy_decode_worker(stack)
    assert killed is not None
    assert finish == "length" and tokens == expected
    assert migrations(stack) == before + 1

    def traced(spans) -> list:
        return [span for span in spans if span.trace_id == trace_id]

    spans = traced(traces.wait_for(lambda spans: {"pdserve-router", "pdserve-decode"} <= {
        span.service for span in traced(spans)}))  # fmt: skip
    (router,) = [span for span in spans if span.service == "pdserve-router"]
    (decode,) = [span for span in spans if span.service == "pdserve-decode"]
    assert not router.failed and "pdserve.cancelled" not in router.attributes
    assert router.attributes["gen_ai.usage.output_tokens"] == NUM_TOKENS
    assert decode.parent_span_id == router.span_id and not decode.failed
    assert decode.attributes["gen_ai.usage.input_tokens"] == len(prompt)


def test_a_seeded_non_streaming_request_survives_it_too(stack, client, tiny_llama):
    """Seeded sampling with penalties, not streamed: the same tokens as undisturbed,
    since the new worker advances the generator past the draws made before."""
    wait_all_serving(stack)
    prompt = random_prompts((40,), seed=92)[0]
    params = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.9,
                            seed=5, frequency_penalty=0.4)  # fmt: skip
    expected = offline(tiny_llama, prompt, params)
    before = migrations(stack)
    replies = []

    def request() -> None:
        replies.append(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0.9, seed=5,
            frequency_penalty=0.4,
            extra_body={"min_tokens": NUM_TOKENS, "return_token_ids": True},
        ))  # fmt: skip

    thread = threading.Thread(target=request)
    thread.start()
    kill_the_busy_decode_worker(stack, after_s=0.5)  # tokens have reached the router
    thread.join(120)
    [reply] = replies
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == NUM_TOKENS
    assert choice.model_extra["token_ids"] == expected
    assert migrations(stack) == before + 1


def test_nothing_is_left_held_after_the_migrations(stack):
    wait_all_serving(stack)
    for decode in worker_stats(stack, "decode"):
        assert (decode.num_running, decode.num_waiting, decode.kv_blocks_used) == (0, 0, 0)
    [held] = worker_stats(stack, "prefill")
    assert (held.num_running, held.kv_blocks_used, held.live_leases) == (0, 0, 0)
