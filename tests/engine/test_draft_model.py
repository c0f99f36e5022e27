"""Speculative decoding with a separate draft model (``engine.speculative_method:
draft_model``, ``engine/draft_model.py``). The target itself as its own draft is an
oracle: every draft it proposes is right, so any draft KV it misreads (a position it
never read, a prompt it never saw) shows as a draft not kept."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file, save_file

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.config_loader import build
from common.engine_config import EngineConfig
from common.kv_budget import kv_budgets
from deploy.cli import main
from engine import LLM, LLMEngine, SamplingParams
from engine.models.maker import make_model
from engine.scheduler import SchedulerOutput
from tests.engine.helpers import random_prompts
from tests.engine.local_puller import LocalPuller
from tests.engine.test_disaggregation import hand_off, run

POOL = dict(dtype="float32", kv_cache_bytes=32 << 20)
PARAMS = SamplingParams(max_tokens=33, min_tokens=33, temperature=0)


def _drafting(draft, k: int = 3, **more) -> dict:
    return dict(POOL, speculative_method="draft_model", draft_model=str(draft),
                num_speculative_tokens=k, **more)  # fmt: skip


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_the_target_as_its_own_draft_keeps_every_draft(tiny_llama):
    """k drafts a step, all kept (the slots of the draft's own positions are taken
    ahead: ``Scheduler._lookahead``); the tokens of decoding without drafts, in a
    quarter of the decode steps. A second round over the same prompts starts from
    prefix-cache hits, whose blocks hold the draft's KV too."""
    prompts = random_prompts((20, 50), seed=2)
    plain = _tokens(LLM(tiny_llama, **POOL).generate(prompts, PARAMS, use_tqdm=False))
    with LLM(tiny_llama, **_drafting(tiny_llama)) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == plain
        scheduler = llm.engine.scheduler
        assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens == 2 * 8 * 3
        assert llm.engine.num_steps == 1 + 8  # the prompts, then 4 tokens a step
        again = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert _tokens(again) == plain
        assert llm.engine.scheduler.kv.num_hit_tokens > 0
        assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens == 2 * 2 * 8 * 3
        assert llm.engine.leak_report() == []


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16])
def test_a_prompt_that_fills_its_blocks_keeps_every_draft(tiny_llama, max_num_batched_tokens):
    """Prompts of whole blocks (16 tokens each): the step that computes the last of them
    has no slot yet for the token it samples, so the draft reads that token in the
    next step. It was recorded as read, its KV never written, and a third to a half of
    the oracle's drafts were refused for the rest of the request. With 16-token chunks
    every chunk of a prompt ends at a block boundary."""
    prompts = random_prompts((32, 48), seed=4)
    plain = _tokens(LLM(tiny_llama, **POOL).generate(prompts, PARAMS, use_tqdm=False))
    more = dict(max_num_batched_tokens=max_num_batched_tokens)
    with LLM(tiny_llama, **_drafting(tiny_llama, **more)) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == plain
        scheduler = llm.engine.scheduler
        assert scheduler.num_draft_tokens > 0
        assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens
        assert llm.engine.leak_report() == []


def test_another_models_drafts_never_change_the_tokens(tiny_llama, tmp_path):
    """A different model (Qwen2, other weights) as the draft, greedy and seeded: drafts
    are kept only where they are the tokens the target samples."""
    draft = make_model("qwen2", "tiny", tmp_path / "qwen2", seed=5)
    prompts = random_prompts((7, 40, 90), seed=6)
    for params in (PARAMS, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3)):
        plain = _tokens(LLM(tiny_llama, **POOL).generate(prompts, params, use_tqdm=False))
        with LLM(tiny_llama, **_drafting(draft, k=2)) as llm:
            assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
            assert llm.engine.scheduler.num_draft_tokens > 0
            assert llm.engine.leak_report() == []


def test_a_draft_with_fewer_token_ids(tiny_llama, tmp_path):
    """The draft's vocabulary is the first 1024 of the target's 2048 ids (as small Qwen2.5
    models pad fewer rows): target tokens beyond it reach the draft as token 0 (not an
    index past its embeddings), and the tokens stay the target's."""
    draft = tmp_path / "fewer-ids"
    draft.mkdir()
    for path in tiny_llama.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            (draft / path.name).write_bytes(path.read_bytes())
    config = json.loads((tiny_llama / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][:1024].clone()
    save_file(tensors, str(draft / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts((30, 60), seed=12)
    plain = LLM(tiny_llama, **POOL).generate(prompts, PARAMS, use_tqdm=False)
    assert any(t >= 1024 for output in plain for t in output.outputs[0].token_ids)
    with LLM(tiny_llama, **_drafting(draft, k=2)) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == _tokens(plain)
        assert llm.engine.scheduler.num_draft_tokens > 0
        assert llm.engine.leak_report() == []


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 64])
def test_a_decode_worker_reads_the_prompt_into_its_draft(tiny_llama, max_num_batched_tokens):
    """Prefill on one engine, decode on another: the prompt's target KV comes with its
    blocks, the draft's does not, so the decode engine's first step leads the draft with
    the whole prompt. Every draft is then right, as on one engine; without the prompt
    the draft would guess from the first token on. With a budget of 64 tokens a step,
    the draft catches up over several steps (no pass reads more than the budget and the
    steps' own tokens), proposing nothing until it has."""
    config = EngineConfig(**_drafting(tiny_llama, max_num_batched_tokens=max_num_batched_tokens))
    prompts = random_prompts((40, 75, 100), seed=4)
    params = SamplingParams(max_tokens=17, min_tokens=17, temperature=0)
    colocated = LLMEngine(tiny_llama, config)
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"r{i}", prompt, params)
    expected = {rid: out.outputs[0].token_ids for rid, out in run(colocated).items()}
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama, config)
    decode = LLMEngine(tiny_llama, config, kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    firsts = hand_off(prefill, decode, prompts, params)
    assert all(len(first.draft_token_ids) == 3 for first in firsts.values())
    draft = decode.runner.draft
    run_pass, pass_sizes = draft.run_pass, []

    def recorded(batch, *args):
        pass_sizes.append(len(batch.input_ids))
        return run_pass(batch, *args)

    draft.run_pass = recorded
    got = {rid: out.outputs[0].token_ids for rid, out in run(decode).items()}
    assert got == expected and puller.num_blocks_pulled > 0
    scheduler = decode.scheduler
    assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens > 0
    if max_num_batched_tokens == 2048:
        assert scheduler.num_draft_tokens == colocated.scheduler.num_draft_tokens
        assert max(pass_sizes) > 200  # all three prompts in the first step's pass
    else:  # the budget, and each request's first token, 3 drafts kept and 1 sampled
        assert max(pass_sizes) <= 64 + 3 * (1 + 3 + 1)
    for i in range(len(prompts)):
        assert prefill.release_kv(f"r{i}")
    for engine in (colocated, prefill, decode):
        assert engine.leak_report() == []


def test_a_tensor_parallel_target_drafts_on_rank_0(tiny_llama):
    prompts = random_prompts((20, 50), seed=2)
    plain = _tokens(LLM(tiny_llama, **POOL).generate(prompts, PARAMS, use_tqdm=False))
    with LLM(tiny_llama, **_drafting(tiny_llama, tensor_parallel_size=2)) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == plain
        scheduler = llm.engine.scheduler
        assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens == 2 * 8 * 3
        assert llm.engine.leak_report() == []


def test_a_prefix_back_from_the_cpu_tier_brings_the_drafts_kv(tiny_llama):
    """A prefix pushed out of the device pool comes back from the CPU tier with the
    draft's KV too (the tier holds both models' blocks), so every draft stays right."""
    prefix = random_prompts((160,), seed=91)[0]  # 10 full blocks
    fillers = random_prompts((200, 200, 200), seed=92)
    small = _drafting(tiny_llama, num_blocks=40, max_model_len=256, cpu_offload_bytes=64 << 20)
    small.pop("kv_cache_bytes")
    engine = LLMEngine(tiny_llama, EngineConfig(**small))
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0)
    for i, prompt in enumerate([prefix + [1, 2, 3], *fillers]):  # the fillers push it out
        engine.add_request(f"warm{i}", prompt, params)
        run(engine)
    scheduler = engine.scheduler
    drafted, kept = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    assert drafted == kept
    engine.add_request("q", prefix + [7, 8, 9], params)
    (out,) = run(engine).values()
    assert engine.cpu_tier.stats.hit_blocks == 10 and out.num_cached_tokens == 160
    assert scheduler.num_draft_tokens - drafted == scheduler.num_accepted_tokens - kept > 0
    assert engine.leak_report() == []


def test_preempted_requests_draft_again(tiny_llama):
    """A pool too small for every request at once: preempted requests recompute, their
    draft with them, and still every draft is right."""
    prompts = random_prompts((60, 61, 62, 63), seed=9)
    plain = _tokens(LLM(tiny_llama, **POOL).generate(prompts, PARAMS, use_tqdm=False))
    small = _drafting(tiny_llama, num_blocks=14, block_size=16, max_model_len=128)
    small.pop("kv_cache_bytes")
    with LLM(tiny_llama, **small) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == plain
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0
        assert scheduler.num_draft_tokens == scheduler.num_accepted_tokens > 0
        assert llm.engine.leak_report() == []


def test_a_preemption_at_a_block_boundary_after_a_step_without_drafts(tiny_llama):
    """The draft had read one token past what the target computed (a decode step that
    kept no drafts, as when the pool had no room for them), at a block boundary; the
    request was preempted, and its prefix hit ended right there. The draft's KV of that
    position was in a block the re-admission took fresh, and no lead re-read it: every
    later draft attended to garbage (an audit: 14 of 26 oracle drafts kept). The
    preemption now forgets how far the draft had read."""
    prompt = random_prompts((47,), seed=5)[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = LLMEngine(tiny_llama, EngineConfig(**_drafting(tiny_llama)))
    engine.add_request("a", prompt, params)
    engine.step()  # the prompt: 47 tokens
    request = engine.scheduler.requests["a"]
    request.model_draft_ids = []  # a step without drafts
    engine.step()
    assert (request.num_computed_tokens, request.draft_kv_end) == (48, 49)
    engine.scheduler.running.remove(request)
    engine.scheduler._preempt(request, SchedulerOutput())  # (as its victims)
    drafts, kept = engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    (expected,) = _tokens(LLM(tiny_llama, **POOL).generate([prompt], params, use_tqdm=False))
    assert outputs["a"].outputs[0].token_ids == expected
    assert engine.scheduler.num_draft_tokens - drafts > 0
    assert engine.scheduler.num_draft_tokens - drafts == engine.scheduler.num_accepted_tokens - kept
    assert engine.leak_report() == []


def test_bad_drafts_are_refused(tiny_llama, model_factory, tmp_path):
    with pytest.raises(ConfigError, match="needs the draft's checkpoint") as error:
        EngineConfig(speculative_method="draft_model")
    assert error.value.key == "engine.draft_model"
    with pytest.raises(ConfigError, match="only with speculative_method draft_model"):
        EngineConfig(draft_model=str(tiny_llama))
    with pytest.raises(ConfigError, match="does not exist") as error:
        LLMEngine(tiny_llama, EngineConfig(**_drafting(tmp_path / "nowhere")))
    assert error.value.key == "engine.draft_model"
    bigger = model_factory("llama", "small")  # 8192 token ids against 2048
    with pytest.raises(ConfigError, match="larger than the target's"):
        LLMEngine(tiny_llama, EngineConfig(**_drafting(bigger)))


def test_config_check_sizes_the_pool_with_the_drafts_kv(
    tiny_llama, model_factory, tmp_path, capsys
):
    """``pdserve config check`` counts the draft's KV in every block (the pool the engine
    then makes), and refuses a draft that is missing or uses other token ids."""
    layout = tmp_path / "layout.yaml"
    layout.write_text(
        f"model: {tiny_llama}\n"
        "engine: {speculative_method: draft_model, num_speculative_tokens: 2, "
        f"draft_model: {tiny_llama}, device: cpu, dtype: float32, kv_cache_bytes: 33554432}}\n"
    )
    config = build(PdserveConfig, yaml.safe_load(layout.read_text()))
    budget = kv_budgets(config)[0]
    engine = LLMEngine(tiny_llama, config.engine_for(Role.DECODE))
    draft = engine.runner.draft
    assert budget.cpu_bytes_per_block == engine.runner.bytes_per_block + draft.bytes_per_block
    assert budget.num_blocks == engine.runner.num_blocks == draft.shard.num_blocks
    assert engine.leak_report() == []
    assert main(["config", "check", str(layout)]) == 0
    bigger = model_factory("llama", "small")
    for draft_dir, error in ((tmp_path / "nowhere", "holds no config.json"),
                             (bigger, "larger than the target's")):  # fmt: skip
        args = ["config", "check", str(layout), "--set", f"engine.draft_model={draft_dir}"]
        assert main(args) == 2
        assert f"error: engine.draft_model: {draft_dir}" in (err := capsys.readouterr().err)
        assert error in err
