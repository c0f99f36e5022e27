"""Engine behaviour on a real tiny model: caching, chunking, preemption, sampling, stops."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.config_base import ConfigError
from engine import LLM, SamplingParams
from engine.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from tests.engine.helpers import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, min_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(seed=1)


@pytest.fixture(scope="module")
def baseline(tiny_llama, prompts) -> list[list[int]]:
    llm = LLM(tiny_llama, enable_prefix_caching=False)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.leak_report() == []
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "overrides",
    [
        {"enable_prefix_caching": True},
        {"prefill_chunk_tokens": 1},
        {"prefill_chunk_tokens": 7},
        {"prefill_chunk_tokens": None, "max_num_batched_tokens": 4096},
        {"max_num_batched_tokens": 40, "max_num_seqs": 3},
        {"block_size": 32},
    ],
    ids=["prefix-cache", "chunk-1", "chunk-7", "unlimited", "tight-budget", "block-32"],
)
def test_identical_output_across_configs(tiny_llama, prompts, baseline, overrides):
    llm = LLM(tiny_llama, **overrides)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    assert llm.engine.leak_report() == []


def test_identical_output_under_preemption(tiny_llama, prompts, baseline):
    # 20 blocks of 16 tokens hold 320 tokens; the batch needs ~660 at once.
    llm = LLM(tiny_llama, num_blocks=20, max_model_len=256)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    assert llm.engine.leak_report() == []


def test_priority_reorders_service_and_keeps_the_tokens(tiny_llama, prompts, baseline):
    # Priorities reversed against the input order, three batch slots and too few blocks:
    # first tokens come in priority order, preemptions happen, and every sequence is the
    # one FCFS computes.
    priority = list(range(len(prompts), 0, -1))
    llm = LLM(tiny_llama, scheduling_policy="priority", max_num_seqs=3, num_blocks=16,
              max_model_len=256)  # fmt: skip
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    by_priority = sorted(range(len(prompts)), key=priority.__getitem__)
    first_tokens = [outputs[i].times.first_token for i in by_priority]
    assert first_tokens == sorted(first_tokens)
    assert first_tokens[0] < first_tokens[-1]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.leak_report() == []


def test_priority_needs_the_priority_policy(tiny_llama, prompts):
    llm = LLM(tiny_llama)
    for bad, match in ((1, "needs engine.scheduling_policy: priority"), (2**31, "integer in"),
                       (True, "integer in"), (1.0, "integer in")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=match) as info:
            llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0, bad])
        assert info.value.param == "priority"
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0])
    assert llm.engine.leak_report() == [] and not llm.engine.has_unfinished_requests()


def test_shared_prefix_is_served_from_cache(tiny_llama, prompts):
    llm = LLM(tiny_llama)
    prefix = prompts[-1][:64]
    first = llm.generate([prefix + [7, 8, 9]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prefix + [10, 11]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    fresh = LLM(tiny_llama, enable_prefix_caching=False)
    expected = fresh.generate([prefix + [10, 11]], GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert llm.engine.leak_report() == [] and fresh.engine.leak_report() == []


@pytest.mark.parametrize("chunk", [64, 7])
def test_prompts_prefilled_side_by_side_compute_their_shared_part_once(tiny_llama, chunk):
    """Four prompts sharing 320 tokens, admitted together, prefilled in chunks: each used
    to compute all of it (a request looks the cache up only when admitted, so they went
    in lockstep, each a chunk ahead of the last). A running request now takes the blocks
    another has computed since. Chunks of 64 stay on block boundaries (16 tokens), so the
    shared part is computed once. Chunks of 7 keep all four at one mid-block position,
    none ahead of another, so nothing is there to take: the lockstep stays (ending it
    would mean holding one back a step). Same tokens either way."""
    shared = random_prompts((320,), seed=12)[0]
    prompts = [shared + suffix for suffix in random_prompts((5, 9, 13, 2), seed=13)]
    fresh = LLM(tiny_llama, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(tiny_llama, prefill_chunk_tokens=chunk)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    computed = llm.engine.num_prompt_tokens_computed
    suffixes = sum(len(p) - 320 for p in prompts)
    if chunk == 64:
        assert computed == 320 + suffixes  # 320 is 20 blocks: nothing computed twice
        cached = sum(o.num_cached_tokens for o in outputs)
        assert cached == 3 * 320 and llm.engine.scheduler.kv.num_hit_tokens == cached
    else:
        assert computed > 2 * 320  # the lockstep as before
    assert llm.engine.leak_report() == [] and fresh.engine.leak_report() == []


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama, prompts):
    llm = LLM(tiny_llama)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate([prompts[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0)] * 3
    batch = llm.generate(prompts[:4], [others[0], others[1], params, others[2]], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99)
    different = llm.generate([prompts[2]], other_seed, use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("only_the_top", [{"top_k": 1}, {"min_p": 1.0}], ids=["top-k", "min-p"])
def test_keeping_only_the_top_token_is_greedy(tiny_llama, prompts, baseline, only_the_top):
    llm = LLM(tiny_llama)
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=1.5, seed=3,
                            **only_the_top)  # fmt: skip
    outputs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == baseline[:3]
    assert llm.engine.leak_report() == []


def _openai_penalties(presence: float, frequency: float):
    """An independent oracle for OpenAI's presence/frequency penalties: a transformers
    logits processor over the generated tokens."""
    from transformers import LogitsProcessor

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, prompt_len: int) -> None:
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            generated = input_ids[0, self.prompt_len :]
            if generated.numel():
                token_ids, counts = generated.unique(return_counts=True)
                scores[0, token_ids] -= frequency * counts + presence
            return scores

    return lambda prompt_len: [OpenAIPenalties(prompt_len)]


def test_penalties_match_transformers_whatever_the_batch(tiny_llama, prompts, baseline):
    """Repetition (prompt + output), presence and frequency (output) penalties, greedy,
    against transformers; penalised requests batched with plain ones are unaffected by
    them, and the plain ones by the penalised."""
    penalised = SamplingParams(
        max_tokens=24, min_tokens=24, temperature=0, repetition_penalty=1.3,
        presence_penalty=0.5, frequency_penalty=0.4,
    )  # fmt: skip
    expected = hf_greedy(tiny_llama, prompts[:3], 24, _openai_penalties(0.5, 0.4),
                         repetition_penalty=1.3)  # fmt: skip
    assert expected != baseline[:3]  # the penalties change these tokens
    llm = LLM(tiny_llama)
    mixed = [penalised, GREEDY, penalised, GREEDY, penalised, GREEDY]
    sources = [prompts[0], prompts[3], prompts[1], prompts[4], prompts[2], prompts[5]]
    outputs = [o.outputs[0].token_ids for o in llm.generate(sources, mixed, use_tqdm=False)]
    assert outputs[0::2] == expected
    assert outputs[1::2] == [baseline[3], baseline[4], baseline[5]]
    assert llm.engine.leak_report() == []


def test_default_sampling_params_come_from_generation_config(tiny_llama, prompts, tmp_path):
    shutil.copytree(tiny_llama, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0,
                                "repetition_penalty": 1.3, "top_k": 5}))  # fmt: skip
    llm = LLM(tmp_path)
    assert llm.default_sampling_params() == SamplingParams(
        temperature=0.0, repetition_penalty=1.3, top_k=5
    )
    unset = llm.generate(prompts[:2], use_tqdm=False)
    explicit = llm.generate(prompts[:2], llm.default_sampling_params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in unset] == [o.outputs[0].token_ids for o in explicit]


def test_stop_token_ids_and_max_tokens(tiny_llama, prompts, baseline):
    llm = LLM(tiny_llama)
    stop_token = baseline[0][5]
    first_index = baseline[0].index(stop_token)
    out = llm.generate(
        [prompts[0]],
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == baseline[0][: first_index + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    # Its text is not output (as in vLLM): the text is that of the tokens before it.
    assert out.text == llm.tokenizer.decode(baseline[0][:first_index])
    short = llm.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert short[0].outputs[0].token_ids == baseline[0][:3]
    assert short[0].outputs[0].finish_reason == "length"
    assert llm.engine.leak_report() == []


@pytest.fixture(scope="module")
def eos_model(tiny_llama, baseline, tmp_path_factory):
    """The tiny model with its EOS set to a token that greedy decoding of prompt 0 emits."""
    target = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(tiny_llama, target, dirs_exist_ok=True)
    eos = baseline[0][6]
    gen = json.loads((target / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (target / "generation_config.json").write_text(json.dumps(gen))
    return target, eos, baseline[0].index(eos)


def test_eos_ignore_eos_and_min_tokens(eos_model, prompts, baseline):
    model_dir, eos, eos_index = eos_model
    llm = LLM(model_dir)
    stops = llm.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert stops[0].outputs[0].token_ids == baseline[0][: eos_index + 1]
    assert stops[0].outputs[0].finish_reason == "stop"
    ignored = llm.generate(
        [prompts[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert ignored[0].outputs[0].token_ids == baseline[0]
    assert ignored[0].outputs[0].finish_reason == "length"
    min_tokens = eos_index + 3
    held = llm.generate(
        [prompts[0]],
        SamplingParams(max_tokens=24, min_tokens=min_tokens, temperature=0),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= min_tokens
    assert eos not in held.token_ids[:min_tokens]
    # With ignore_eos too, EOS is banned before min_tokens (vLLM's rule), and allowed after.
    exact = SamplingParams(max_tokens=24, min_tokens=min_tokens, temperature=0, ignore_eos=True)
    both = llm.generate([prompts[0]], exact, use_tqdm=False)[0].outputs[0]
    assert both.token_ids[:min_tokens] == held.token_ids[:min_tokens]
    assert len(both.token_ids) == 24 and both.finish_reason == "length"
    assert llm.engine.leak_report() == []


def test_logprobs_match_transformers(tiny_llama, prompts):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama)
    out = llm.generate(
        [prompts[3]], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False
    )[0].outputs[0]
    (lp,) = out.logprobs
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompts[3]])).logits[0, -1]
    reference = logits.log_softmax(-1).topk(5)
    assert lp.token_id == out.token_ids[0] == reference.indices[0].item()
    assert lp.rank == 1
    assert list(lp.top_token_ids) == reference.indices.tolist()
    assert torch.allclose(torch.tensor(lp.top_logprobs), reference.values, atol=1e-4)
    assert lp.logprob == pytest.approx(lp.top_logprobs[0])
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16, "block_size": 16}])
def test_prompt_logprobs_match_transformers(tiny_llama, prompts, overrides):
    """Every prompt token after the first is scored against transformers' distribution,
    also in chunks (16-token steps) and when the prompt's blocks are already cached: a
    scoring request computes its whole prompt, since a cached block has no logits."""
    from transformers import AutoModelForCausalLM

    prompt = prompts[3]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    llm = LLM(tiny_llama, **overrides)
    llm.generate([prompt], GREEDY, use_tqdm=False)  # the prompt's blocks are now cached
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    scored = output.prompt_logprobs
    assert output.num_cached_tokens == 0 and len(scored) == len(prompt) and scored[0] is None
    for position, lp in enumerate(scored[1:]):
        expected = reference[position]
        assert lp.token_id == prompt[position + 1]
        assert lp.logprob == pytest.approx(expected[lp.token_id].item(), abs=1e-4)
        assert lp.rank == int((expected > expected[lp.token_id]).sum()) + 1
        assert list(lp.top_token_ids) == expected.topk(3).indices.tolist()
    # Not asked for: none, and the cache is used again.
    (plain,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    assert llm.engine.leak_report() == []


def test_a_max_model_len_past_the_models_context_is_refused_by_name(tiny_llama):
    """As in vLLM: it was cut to the context (4096) with a warning, so an engine asked for
    100k tokens served 4k and called longer prompts too long."""
    with pytest.raises(ConfigError, match="beyond the model's context of 4096") as error:
        LLM(tiny_llama, max_model_len=4097)
    assert error.value.key == "engine.max_model_len"
    assert LLM(tiny_llama, max_model_len=4096, num_blocks=300).engine.max_model_len == 4096


def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_llama, prompts, baseline):
    llm = LLM(tiny_llama, max_model_len=128)
    with pytest.raises(EmptyPromptError):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(PromptTooLongError, match="maximum context length is 128"):
        llm.generate([[5] * 129], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[5, 10**6]], GREEDY, use_tqdm=False)
    # Stop ids the sampler would ban before min_tokens: beyond the vocabulary (an index
    # error in the step, failing every request), or all of it (nothing left to sample).
    vocab = llm.engine.arch.vocab_size
    for stop_ids, match in (([vocab], r"stop_token_ids must be in \[0"),
                            (list(range(vocab)), "whole vocabulary")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=match):
            params = SamplingParams(max_tokens=4, min_tokens=2, temperature=1.0,
                                    stop_token_ids=stop_ids)  # fmt: skip
            llm.generate([prompts[0]], params, use_tqdm=False)
    # Likewise token ids to bias or allow beyond the vocabulary, and allowed ids that the
    # bans before min_tokens leave empty.
    for bad, param in (({"logit_bias": {vocab: 1.0}}, "logit_bias"),
                       ({"allowed_token_ids": (1, vocab)}, "allowed_token_ids"),
                       ({"allowed_token_ids": (7,), "stop_token_ids": (7,)},
                        "allowed_token_ids")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as info:
            params = SamplingParams(max_tokens=4, min_tokens=2, temperature=1.0, **bad)
            llm.generate([prompts[0]], params, use_tqdm=False)
        assert info.value.param == param
    for bad in (
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -5},
        {"max_tokens": 0},
        {"min_tokens": 10, "max_tokens": 5},
        {"logprobs": 100},
    ):
        with pytest.raises(InvalidSamplingParamsError) as info:
            SamplingParams(**bad)
        assert info.value.param in bad
    # Nothing half-admitted: a batch with one bad prompt admits none of them.
    with pytest.raises(EmptyPromptError):
        llm.generate([prompts[0], []], GREEDY, use_tqdm=False)
    assert llm.engine.leak_report() == []
    out = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == baseline[0]
    assert llm.engine.leak_report() == []


def test_prefix_hit_stats_count_each_admission_once(tiny_llama):
    """A request that waits for room looks its prefix up every step; the stats count the
    lookup that admitted it, so the hit rate means something under memory pressure."""
    engine = LLM(tiny_llama, num_blocks=4, max_model_len=64).engine
    first, second = random_prompts((40, 40), seed=11)
    engine.add_request("first", first, GREEDY)  # 3 of the 4 blocks, then all 4
    engine.add_request("second", second, GREEDY)  # waits for room until the first ends
    finished = set()
    while engine.has_work():
        finished |= {o.request_id for o in engine.step() if o.finished}
    kv = engine.scheduler.kv
    assert finished == {"first", "second"} and engine.num_steps > 10
    assert engine.scheduler.num_preemptions == 0
    assert kv.num_query_tokens == 80  # two admissions of 40 tokens, however long it waited
    assert kv.num_hit_tokens == 0
    assert engine.leak_report() == []


def test_abort_mid_generation_frees_everything(tiny_llama, prompts):
    llm = LLM(tiny_llama)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=50, temperature=0))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.kv.pool.num_used_blocks > 0
    for i in range(len(prompts)):
        output = engine.abort_request(f"r{i}")
        assert output is not None and output.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.leak_report() == []


def test_text_prompts_and_order(tiny_llama):
    llm = LLM(tiny_llama)
    texts = ["def main():", "The quick brown fox", "x"]
    outputs = llm.generate(texts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert [o.prompt for o in outputs] == texts
    for text, output in zip(texts, outputs, strict=True):
        assert output.prompt_token_ids == llm.tokenizer.encode(text)
        assert output.outputs[0].text == llm.tokenizer.decode(output.outputs[0].token_ids)
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize(
    ("memory", "key"),
    [
        ({"num_blocks": 4}, "engine.num_blocks"),
        ({"kv_cache_bytes": 100_000}, "engine.kv_cache_bytes"),
    ],
)
def test_a_pool_too_small_names_the_setting_that_sized_it(tiny_llama, memory, key):
    """It always named engine.num_blocks, which the operator may never have set."""
    from common.config_base import ConfigError

    with pytest.raises(ConfigError, match="cannot hold one request") as error:
        LLM(tiny_llama, device="cpu", **memory)
    assert error.value.key == key


def test_gpu_memory_utilization_is_each_instances_share_of_the_card(monkeypatch):
    """Two workers at 0.4 on one 80 GiB card (the runbook's 1P1D on one GPU): the
    budget was "what is free, less 0.6 of the card", which counted the first worker's
    memory against the second and left it -2 GiB (an audit). Each gets 0.4 of the card
    less its own weights now, and never past what is free less a reserve. (torch.cuda's
    memory queries faked: no GPU here.)"""
    import torch

    from engine import model_shard

    gib, total = 1 << 30, 80 << 30
    card = {"used": 0, "own": 0}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - card["used"], total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: card["own"])
    budgets = []
    for _ in range(2):
        card["own"] = 2 * gib  # this worker's weights, loaded before the pool is sized
        card["used"] += card["own"]
        budgets.append(model_shard._cuda_kv_budget(torch.device("cuda"), 0.4))
        card["used"] += budgets[-1]
    assert budgets == [int(0.4 * total) - 2 * gib] * 2
    # Alone at 0.85 (the default): 0.85 of the card less its weights, as before.
    card["used"] = card["own"] = 2 * gib
    assert model_shard._cuda_kv_budget(torch.device("cuda"), 0.85) == int(0.85 * total) - 2 * gib
    # Whatever the share, not past what is free less the reserve (another process holds
    # 70 GiB here).
    card["used"] = 72 * gib
    free_less_reserve = 8 * gib - int(total * model_shard.FREE_RESERVE)
    assert model_shard._cuda_kv_budget(torch.device("cuda"), 0.85) == free_less_reserve
