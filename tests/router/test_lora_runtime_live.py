"""LoRA adapters loaded and unloaded while a real ``pdserve up`` stack serves (router +
1 prefill + 1 decode worker, shared-storage connector, ``lora.runtime_loading``): vLLM's
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` reach every worker; a loaded
adapter's tokens equal the offline engine's with it; a failed load leaves nothing loaded;
other files loaded under an old name never read the old files' KV (prefix caches and the
shared store are keyed by the adapter's weights); a worker that restarts gets the
runtime-loaded adapters back before it serves them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest

from engine import LLM, SamplingParams
from engine.models.lora_maker import make_lora_adapter
from tests.support.processes import write_config
from tests.support.stack import get_json, serving, worker_stats

MODEL = "base-model"
PROMPT = "The quarterly report shows that revenue grew in every region, " * 6
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("runtime-adapters")
    return {
        "a": str(make_lora_adapter(tiny_llama, root / "a", rank=8, seed=21)),
        "b": str(make_lora_adapter(tiny_llama, root / "b", rank=8, seed=22)),
        "bob": str(make_lora_adapter(tiny_llama, root / "bob", rank=4, seed=23)),
    }


@pytest.fixture(scope="module")
def stack(tiny_llama, adapter_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-runtime")
    config = write_config(
        tmp / "config.yaml",
        tiny_llama,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0, "refresh_interval_s": 0.5},
        kv_transfer={"connector": "shared_storage", "shared_dir": str(tmp / "kv")},
        lora={"adapters": {"bob": adapter_dirs["bob"]}, "runtime_loading": True},
    )
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return stack.openai_client()


@pytest.fixture(scope="module")
def expected(tiny_llama, adapter_dirs) -> dict[str, list[int]]:
    """The offline engine's greedy tokens for PROMPT with each adapter's files."""
    offline = LLM(tiny_llama, lora_adapters={k: adapter_dirs[k] for k in ("a", "b")})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {
        name: offline.generate([PROMPT], params, use_tqdm=False, lora_name=name)[0]
        .outputs[0].token_ids
        for name in ("a", "b")
    }  # fmt: skip
    assert tokens["a"] != tokens["b"]
    return tokens


def post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.base_url}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def complete(client: openai.OpenAI, model: str, prompt: str = PROMPT):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip


def tokens_of(reply) -> list[int]:
    return reply.choices[0].model_extra["token_ids"]


def served(stack) -> dict[str, dict[str, str]]:
    """Per role, the adapters its worker reports (name -> fingerprint)."""
    return {
        role: {a.name: a.fingerprint for a in worker_stats(stack, role)[0].lora_adapters}
        for role in ("prefill", "decode")
    }


def model_ids(stack) -> set[str]:
    status, body = get_json(f"{stack.base_url}/v1/models")
    assert status == 200
    return {card["id"] for card in body["data"]}


def test_a_load_reaches_every_worker_and_serves_the_adapter(stack, client, adapter_dirs, expected):
    assert model_ids(stack) == {MODEL, "bob"}
    with pytest.raises(openai.NotFoundError):
        complete(client, "alice")
    status, body = post(stack, "/v1/load_lora_adapter",
                        {"lora_name": "alice", "lora_path": adapter_dirs["a"]})  # fmt: skip
    assert status == 200, body
    assert body["id"] == "alice" and body["num_workers"] == 2
    adapters = served(stack)
    assert adapters["prefill"]["alice"] == adapters["decode"]["alice"] == body["fingerprint"]
    assert model_ids(stack) == {MODEL, "bob", "alice"}
    card = get_json(f"{stack.base_url}/v1/models/alice")[1]
    assert (card["root"], card["parent"]) == (adapter_dirs["a"], MODEL)
    assert tokens_of(complete(client, "alice")) == expected["a"]
    # The same files again: nothing changes.
    status, again = post(stack, "/v1/load_lora_adapter",
                         {"lora_name": "alice", "lora_path": adapter_dirs["a"]})  # fmt: skip
    assert status == 200 and again["fingerprint"] == body["fingerprint"]


def test_refused_loads_and_unloads_change_nothing(stack, client, adapter_dirs, expected, tmp_path):
    before = served(stack)
    cases = [
        ({"lora_name": "carol", "lora_path": str(tmp_path)}, 400, "lora_path"),
        ({"lora_name": "carol", "lora_path": ""}, 400, "lora_path"),
        ({"lora_name": "no spaces", "lora_path": adapter_dirs["b"]}, 400, "lora_name"),
        ({"lora_name": MODEL, "lora_path": adapter_dirs["b"]}, 400, "lora_name"),
        # Other files under a loaded name: unload first.
        ({"lora_name": "alice", "lora_path": adapter_dirs["b"]}, 400, "lora_name"),
    ]
    for body, status, param in cases:
        got, reply = post(stack, "/v1/load_lora_adapter", body)
        assert got == status, (body, reply)
        assert reply["error"]["param"] == param, (body, reply)
    got, reply = post(stack, "/v1/unload_lora_adapter", {"lora_name": "bob"})  # configured
    assert got == 400 and "lora.adapters" in reply["error"]["message"]
    got, reply = post(stack, "/v1/unload_lora_adapter", {"lora_name": "carol"})
    assert got == 404, reply
    assert served(stack) == before
    assert "carol" not in model_ids(stack)
    assert tokens_of(complete(client, "alice")) == expected["a"]


def test_an_unload_lets_the_adapters_requests_in_flight_finish(
    tiny_llama, stack, client, adapter_dirs
):
    assert post(stack, "/v1/load_lora_adapter",
                {"lora_name": "dora", "lora_path": adapter_dirs["a"]})[0] == 200  # fmt: skip
    num_tokens = 200
    offline = LLM(tiny_llama, lora_adapters={"dora": adapter_dirs["a"]})
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    (want,) = offline.generate(["Once"], params, use_tqdm=False, lora_name="dora")
    stream = client.completions.create(
        model="dora", prompt="Once", max_tokens=num_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    chunks = iter(stream)
    streamed = list(next(chunks).choices[0].model_extra.get("token_ids") or [])
    unloaded: dict = {}

    def unload() -> None:
        unloaded["reply"] = post(stack, "/v1/unload_lora_adapter", {"lora_name": "dora"})
        unloaded["at"] = time.monotonic()

    thread = threading.Thread(target=unload)
    thread.start()
    for chunk in chunks:
        for choice in chunk.choices:
            streamed += choice.model_extra.get("token_ids") or []
    streamed_done = time.monotonic()
    thread.join(60)
    assert unloaded["reply"][0] == 200
    assert streamed == want.outputs[0].token_ids
    assert unloaded["at"] >= streamed_done - 0.2  # it waited for the stream
    with pytest.raises(openai.NotFoundError):
        complete(client, "dora")


def test_other_files_under_an_unloaded_name_never_read_the_old_kv(
    stack, client, adapter_dirs, expected
):
    first = complete(client, "alice")
    assert tokens_of(first) == expected["a"]
    assert first.usage.prompt_tokens_details.cached_tokens >= 64  # cached under these files
    status, body = post(stack, "/v1/unload_lora_adapter", {"lora_name": "alice"})
    assert status == 200 and body["deleted"], body
    assert "alice" not in served(stack)["decode"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "alice")
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "alice"})[0] == 404
    status, body = post(stack, "/v1/load_lora_adapter",
                        {"lora_name": "alice", "lora_path": adapter_dirs["b"]})  # fmt: skip
    assert status == 200, body
    # The same prompt: the old files' blocks are still in both workers' caches and in the
    # shared store, under the old files' key; the new files must compute their own.
    reply = complete(client, "alice")
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert tokens_of(reply) == expected["b"]


def test_a_restarted_worker_gets_the_runtime_adapter_back(stack, client, expected):
    fingerprint = served(stack)["decode"]["alice"]
    os.kill(stack.children()["decode-0"], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:  # the launcher restarts it; the router loads alice on it again
        try:
            reply = complete(client, "alice")
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            assert time.monotonic() < deadline, stack.log()
            time.sleep(1.0)
    assert tokens_of(reply) == expected["b"]
    assert served(stack)["decode"]["alice"] == fingerprint
    assert tokens_of(complete(client, "bob"))  # the configured one is back by itself
