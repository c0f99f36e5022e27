"""LoRA adapters through a real ``pdserve up`` stack (router + 1 prefill + 1 decode worker),
with NIXL and with shared storage: a client picks an adapter by ``model``; the prefill
worker computes the prompt's KV with it, the decode worker continues with it, and the
tokens equal the offline engine's with that adapter (disaggregated equals colocated).
The base model and the adapters never share KV, though their prompts are the same."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from common.config_loader import load_config
from engine import LLM, SamplingParams
from engine.models.lora_maker import make_lora_adapter
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.support.processes import kv_transfer_section, write_config
from tests.support.stack import get_json, serving

MODEL = "base-model"
ADAPTERS = ("alice", "bob")
# Long enough for several full blocks (16 tokens), so the prefix cache and the shared
# store are keyed by hash.
PROMPT = "The quarterly report shows that revenue grew in every region, " * 6
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alice": str(make_lora_adapter(tiny_llama, root / "alice", rank=8, seed=11)),
        "bob": str(
            make_lora_adapter(tiny_llama, root / "bob", rank=4, seed=12, targets=("v_proj",))
        ),
    }


@pytest.fixture(scope="module", params=["nixl", "shared_storage"])
def stack(request, tiny_llama, adapter_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"lora-{request.param}")
    transfer = kv_transfer_section(request.param, tmp / "kv")
    config = write_config(
        tmp / "config.yaml",
        tiny_llama,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0},
        kv_transfer=transfer,
        lora={"adapters": adapter_dirs},
    )
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return stack.openai_client()


@pytest.fixture(scope="module")
def offline(tiny_llama, adapter_dirs) -> LLM:
    return LLM(tiny_llama, lora_adapters=adapter_dirs)


def _expected(offline: LLM, model: str, temperature: float, seed: int | None) -> list[int]:
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, ignore_eos=True
    )
    lora_name = None if model == MODEL else model
    (output,) = offline.generate([PROMPT], params, use_tqdm=False, lora_name=lora_name)
    return output.outputs[0].token_ids


def _ask(model: str, **extra) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}, **extra}  # fmt: skip


def test_models_lists_the_adapters_under_the_base(stack, tiny_llama, adapter_dirs):
    status, body = get_json(f"{stack.base_url}/v1/models")
    assert status == 200
    cards = {card["id"]: card for card in body["data"]}
    assert set(cards) == {MODEL, *ADAPTERS}
    assert all(cards[name]["parent"] == MODEL for name in ADAPTERS)
    assert all(cards[name]["root"] == adapter_dirs[name] for name in ADAPTERS)
    assert cards[MODEL]["parent"] is None and cards[MODEL]["root"] == str(tiny_llama)
    assert get_json(f"{stack.base_url}/v1/models/alice")[1]["id"] == "alice"


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.8, 5)])
def test_each_model_gets_its_own_tokens_disaggregated(client, offline, temperature, seed):
    expected = {model: _expected(offline, model, temperature, seed) for model in (MODEL, *ADAPTERS)}
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters matter
    # Base, then each adapter, then all again: the later ones find the earlier prompts'
    # blocks, where only a hit of the same model may be used.
    for model in (MODEL, *ADAPTERS, *ADAPTERS, MODEL):
        whole = client.completions.create(**_ask(model, temperature=temperature, seed=seed))
        assert whole.model == model
        assert whole.choices[0].model_extra["token_ids"] == expected[model], model
        streamed = []
        for chunk in client.completions.create(
            **_ask(model, temperature=temperature, seed=seed), stream=True
        ):
            for choice in chunk.choices:
                streamed += choice.model_extra.get("token_ids") or []
        assert streamed == expected[model], model


def test_a_repeat_hits_the_cache_of_its_own_adapter_only(client):
    prompt = "Costs fell in the north while sales of new lines held steady. " * 6  # unseen
    cached = {}
    for model in ("alice", "alice", "bob", MODEL):
        reply = client.completions.create(**_ask(model, prompt=prompt))
        cached.setdefault(model, []).append(reply.usage.prompt_tokens_details.cached_tokens)
    assert cached["alice"][0] == 0 and cached["alice"][1] >= 64
    assert cached["bob"] == [0] and cached[MODEL] == [0]


def test_chat_with_an_adapter(client, offline):
    messages = [{"role": "user", "content": "Summarise the report."}]
    reply = client.chat.completions.create(
        model="bob", messages=messages, max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    prompt_ids = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (output,) = offline.generate([prompt_ids], params, use_tqdm=False, lora_name="bob")
    assert reply.model == "bob"
    assert reply.choices[0].model_extra["token_ids"] == output.outputs[0].token_ids


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="carol"):
        client.completions.create(**_ask("carol"))


def test_runtime_loading_is_off_unless_configured(stack, adapter_dirs):
    request = urllib.request.Request(
        f"{stack.base_url}/v1/load_lora_adapter",
        json.dumps({"lora_name": "carol", "lora_path": adapter_dirs["alice"]}).encode(),
        {"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 404
    assert "lora.runtime_loading" in json.loads(refused.value.read())["error"]["message"]
    # The worker refuses too, whoever asks it.
    decode = load_config(str(stack.config_path)).decode
    with grpc.insecure_channel(f"{decode.host}:{decode.ports(0).grpc}") as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as off:
            stub.LoadLoraAdapter(
                pb.LoadLoraAdapterRequest(name="carol", path=adapter_dirs["alice"]), timeout=10
            )
        assert off.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
    assert sorted(a.name for a in stats.lora_adapters) == list(ADAPTERS)
