"""Architectures beyond Llama served disaggregated by a real ``pdserve up`` stack (router +
1 prefill + 1 decode worker): a mixture-of-experts model (Qwen2-MoE: routed experts plus a
gated shared expert), GPT-OSS (attention sinks, biased experts, windows on every other
layer), Mistral (a window on every layer), DeepSeek-V3 (latent attention: one latent
per token moves; its workers draft with its MTP layer, whose KV moves too) and Qwen3.5
with its MTP layer (a hybrid model: its linear-attention states move with the prompt's
KV, and the decode worker verifies drafts keeping the states after each token). The prompt's KV
moves to the decode worker, which continues it, and the client gets exactly the offline
engine's tokens (which drafts nothing), greedy and seeded, whole and streamed.
(Gemma 3 and Phi-3 differ from these only inside the engine: their parity is tested
offline.) Then each model's own chat formats: GPT-OSS's Harmony, Mistral's and DeepSeek's
tool calls."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from common.tokenizer import Tokenizer
from engine import LLM, SamplingParams
from engine.models.maker import add_qwen_mtp_layer
from router.tool_parsers import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP
from tests.support.processes import write_config
from tests.support.stack import serving, worker_stats

MODEL = "served"
# The first prompt runs past GPT-OSS's 64-token window (the maker's).
PROMPTS = ["def add(a, b):\n    return a + b\n" * 8, "Mixture of experts routes each token"]
NUM_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(
    scope="module",
    params=["qwen2_moe", "gpt_oss", "mistral", "deepseek_v3", "qwen3_5", "granite_hybrid"],
)
def model_dir(request, model_factory, tmp_path_factory):
    if request.param == "qwen3_5":  # with an MTP layer, stored as Qwen3.5's releases do
        return add_qwen_mtp_layer(model_factory("qwen3_5"), tmp_path_factory.mktemp("q") / "m")
    return model_factory(request.param)


def _model_type(model_dir) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def _drafts_with_mtp(model_dir) -> bool:
    return _model_type(model_dir) in ("deepseek_v3", "qwen3_5_text")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arch")
    parser = {"mistral": "mistral", "deepseek_v3": "deepseek_v3"}.get(_model_type(model_dir),
                                                                      "none")  # fmt: skip
    mtp = {"speculative_method": "mtp", "num_speculative_tokens": 2}
    config = write_config(
        tmp / "config.yaml",
        model_dir,
        router={"served_model_name": MODEL, "min_disagg_tokens": 0, "tool_call_parser": parser},
        engine=mtp if _drafts_with_mtp(model_dir) else {},
    )
    with serving(config, tmp / "home") as stack:
        yield stack


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(model_dir)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 17)])
def test_disaggregated_tokens_equal_the_offline_engine(
    stack, offline, model_dir, temperature, seed
):
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
    decode = worker_stats(stack, "decode")[0]
    assert decode.blocks_pulled > pulled_before
    if _drafts_with_mtp(model_dir):  # its MTP layer proposed, decode verified
        assert decode.draft_tokens > 0


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_gpt_oss_chat_replies_are_read_in_harmony(stack, model_dir):
    """The router reads GPT-OSS's replies as Harmony with no parser configured: tools in
    ``auto`` are accepted; a response format constrains the final answer, after the
    thinking (made likely to start and to end by a logit bias), which comes back apart,
    whole and streamed, its tokens counted; a free reply's markers never reach the
    client; tool_choice "required" makes it call (by a grammar), and the call comes back
    as one, whole and streamed. Another model's replies are not read so."""
    client: openai.OpenAI = stack.openai_client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if _model_type(model_dir) == "qwen2_moe":
        # Another model's replies are not Harmony: tools in auto need a configured parser.
        with pytest.raises(openai.BadRequestError, match="tool_call_parser"):
            client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    if _model_type(model_dir) != "gpt_oss":
        return
    tokenizer = Tokenizer(model_dir)
    bias = {str(tokenizer.token_id(m)): 8.0 for m in ("<|channel|>", "<|end|>")}
    ask = {"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 64,
           "temperature": 1.0, "seed": 5, "logit_bias": bias,
           "response_format": {"type": "json_schema",
                               "json_schema": {"name": "n", "schema": SCHEMA}},
           "extra_body": {"return_token_ids": True}}  # fmt: skip
    whole = client.chat.completions.create(**ask)
    reply = whole.choices[0]
    thought = reply.message.model_extra["reasoning_content"]
    assert thought and "<|" not in thought
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    assert reply.finish_reason == "stop"
    # The thinking: its message's tokens, from <|channel|> to <|end|>.
    token_ids = reply.model_extra["token_ids"]
    assert token_ids[0] == tokenizer.token_id("<|channel|>")
    assert whole.usage.completion_tokens_details.reasoning_tokens == (
        token_ids.index(tokenizer.token_id("<|end|>")) + 1
    )
    thinking, content = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            thinking += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (thinking, content) == (thought, reply.message.content)
    # tool_choice "required": a grammar makes the model call, after its thinking.
    forced = {**ask, "tool_choice": "required"}
    del forced["response_format"]
    reply = client.chat.completions.create(**forced).choices[0]
    (tool_call,) = reply.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert isinstance(json.loads(tool_call.function.arguments), dict)
    assert reply.message.model_extra["reasoning_content"]
    assert reply.finish_reason == "tool_calls"
    assert reply.model_extra["token_ids"][-1] == tokenizer.token_id("<|call|>")
    calls = [c for chunk in client.chat.completions.create(**forced, stream=True)
             for choice in chunk.choices for c in choice.delta.tool_calls or ()]  # fmt: skip
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", tool_call.function.arguments)
    ]
    # A free reply: whatever the random model writes, no marker reaches the client.
    del ask["response_format"]
    free = client.chat.completions.create(**ask).choices[0]
    shown = (free.message.content or "") + (free.message.model_extra.get("reasoning_content") or "")
    assert "<|" not in shown


def assert_sure_and_calls(client: openai.OpenAI, ask: dict, made: list[tuple[str, dict]]):
    """The reply ``ask`` makes (a grammar writes "Sure." then the calls) comes back as the
    content "Sure." and ``made`` (name, arguments), whole and streamed."""
    reply = client.chat.completions.create(**ask).choices[0]
    assert reply.message.content == "Sure."
    calls = reply.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == made
    assert reply.finish_reason == "tool_calls"
    content, streamed = "", []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            streamed += choice.delta.tool_calls or []
    assert content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == made


def test_mistral_tool_calls_are_read_with_their_markers(stack, model_dir):
    """With ``tool_call_parser: mistral`` the router keeps Mistral's markers (special
    tokens, which decoding drops) in the text: a reply made to call (by a grammar, from
    random weights) comes back as the calls, whole and streamed."""
    if _model_type(model_dir) != "mistral":
        return
    client: openai.OpenAI = stack.openai_client()
    tokenizer = Tokenizer(model_dir)
    tool_calls, args = (f"<[{tokenizer.token_id(m)}]>" for m in ("[TOOL_CALLS]", "[ARGS]"))
    grammar = (f'start: "Sure." {tool_calls} "get_weather" {args} "{{\\"city\\": \\"Paris\\"}}" '
               f'{tool_calls} "get_time" {args} "{{}}"\n')  # fmt: skip
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather and time?"}],
           "tools": [WEATHER_TOOL], "max_tokens": 48, "temperature": 1.0, "seed": 2,
           "extra_body": {"structured_outputs": {"grammar": grammar}}}  # fmt: skip
    made = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert_sure_and_calls(client, ask, made)
    # A stop token that is one of the markers ends the reply without its text (vLLM's
    # rule), even though the parser keeps the markers' text: no call, no "[TOOL_CALLS]".
    stop_id = tokenizer.token_id("[TOOL_CALLS]")
    for extra in ({}, {"skip_special_tokens": False}):
        ask["extra_body"] = {"structured_outputs": {"grammar": grammar},
                             "stop_token_ids": [stop_id], **extra}  # fmt: skip
        reply = client.chat.completions.create(**ask).choices[0]
        assert (reply.message.content, reply.message.tool_calls) == ("Sure.", None)
        assert (reply.finish_reason, reply.model_extra["stop_reason"]) == ("stop", stop_id)
        streamed = client.chat.completions.create(**ask, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "Sure."


def test_deepseek_tool_calls_are_read_with_their_markers(stack, model_dir):
    """With ``tool_call_parser: deepseek_v3`` the router keeps DeepSeek's markers (special
    tokens in the made tokenizer) in the text: a reply made to call in V3.1's format (by a
    grammar, from random weights) comes back as the call, whole and streamed."""
    if _model_type(model_dir) != "deepseek_v3":
        return
    client: openai.OpenAI = stack.openai_client()
    tokenizer = Tokenizer(model_dir)
    markers = (CALLS_BEGIN, CALL_BEGIN, TOOL_SEP, CALL_END, CALLS_END)
    cb, b, sep, e, ce = (f"<[{tokenizer.token_id(marker)}]>" for marker in markers)
    city = '"{\\"city\\": \\"Paris\\"}"'
    grammar = f'start: "Sure." {cb} {b} "get_weather" {sep} {city} {e} {ce}\n'
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
           "tools": [WEATHER_TOOL], "max_tokens": 48, "temperature": 1.0, "seed": 2,
           "extra_body": {"structured_outputs": {"grammar": grammar}}}  # fmt: skip
    assert_sure_and_calls(client, ask, [("get_weather", {"city": "Paris"})])


def test_mtp_prefill_drafts_reach_the_decode_worker(stack, model_dir):
    """The prefill worker's MTP drafts go with the first token (PrefillResponse, then
    GenerateRequest.draft_token_ids): with 3 tokens to generate, the decode worker's one
    step verifies one of them. Without them it would verify none: it drafts only after a
    step, and after its first step one token is left, which drafts nothing."""
    if not _drafts_with_mtp(model_dir):
        pytest.skip("MTP drafts: DeepSeek-V3's and Qwen3.5's stacks")
    client: openai.OpenAI = stack.openai_client()
    before = worker_stats(stack, "decode")[0].draft_tokens
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.usage.completion_tokens == 3
    assert worker_stats(stack, "decode")[0].draft_tokens - before == 1
