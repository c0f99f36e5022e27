"""Speculative decoding on a hybrid model: a decode and its drafts run the recurrence one
token at a time, keeping the linear-attention states after each token in slots of their
own, and the next step starts from the states after the last token the sampler kept
(``LinearStep.verify``, ``ModelRunner._accepted``). Drafts come from a reference run
(``ReplayProposer``; random weights rarely repeat themselves), corrupted at a rate so that
steps keep all, some or none of them. Compared with the engine without drafts: tokens and
log-probs (the tiny model's greedy tokens barely depend on the states; its log-probs do).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.mtp import oracle_qwen_mtp_checkpoint
from benchmarks.speculative import ReplayProposer
from common.config_base import ConfigError
from common.engine_config import EngineConfig
from engine import LLM, LLMEngine, SamplingParams
from engine.models.maker import add_qwen_mtp_layer
from tests.engine.helpers import random_prompts, sampled_logprobs
from tests.engine.models.test_mtp import ReferenceMtp, checked_drafts

VOCAB = 2000
PARAMS = SamplingParams(max_tokens=30, min_tokens=30, temperature=0, logprobs=0)


@pytest.fixture(scope="module")
def plain(hybrid):
    return LLM(hybrid, enable_prefix_caching=False)


def assert_same(got, expected) -> None:
    for output, reference in zip(got, expected, strict=True):
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        assert sampled_logprobs(output) == pytest.approx(sampled_logprobs(reference), abs=1e-4)


def drafting(llm: LLM, references, p_wrong: float, first_id: int = 0) -> LLM:
    """``llm`` drafting from ``references`` (the requests it will be given next, in order:
    ``LLM.generate`` names them offline-<n>)."""
    tokens = {f"offline-{first_id + i}": r.outputs[0].token_ids for i, r in enumerate(references)}
    llm.engine.scheduler.proposer = ReplayProposer(tokens, p_wrong, VOCAB)
    return llm


@pytest.mark.parametrize("p_wrong", [0.0, 0.3, 1.0])
def test_drafts_never_change_the_tokens_or_log_probs(hybrid, plain, p_wrong):
    prompts = random_prompts([5, 17, 33, 64], seed=4)
    expected = plain.generate(prompts, PARAMS, use_tqdm=False)
    llm = drafting(LLM(hybrid, num_speculative_tokens=3), expected, p_wrong)
    assert_same(llm.generate(prompts, PARAMS, use_tqdm=False), expected)
    scheduler = llm.engine.scheduler
    assert scheduler.num_draft_tokens > 0
    if p_wrong == 0.0:
        assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens
    elif p_wrong == 1.0:
        assert scheduler.num_accepted_tokens == 0
    else:
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert llm.engine.leak_report() == []


def test_a_rolling_snapshot_taken_in_a_step_with_drafts_is_the_kept_tokens(hybrid, plain):
    """A 19-token prompt whose drafts are all kept: its decode steps start at 19, 23, 27,
    ... so the ones that reach block boundaries 32 and 48 verify three drafts past them.
    The rolling snapshot there holds the states after the step's first token (a draft's
    slot), not after its drafts: the chat's next turn, from it, has the uncached tokens."""
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0, logprobs=0)
    prompt = random_prompts([19], seed=21)[0]
    (expected,) = plain.generate([prompt], params, use_tqdm=False)
    llm = drafting(LLM(hybrid, num_speculative_tokens=3), [expected], 0.0)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    assert_same([first], [expected])
    # the prompt in two steps (cut at its snapshot after 16), then drafts at every step
    assert llm.engine.num_steps == 2 + -(-39 // 4)
    turn = prompt + first.outputs[0].token_ids + random_prompts([6], seed=22)[0]  # 65 tokens
    (following,) = llm.generate([turn], PARAMS, use_tqdm=False)
    assert following.num_cached_tokens == 48  # from the rolling snapshot after 48 tokens
    assert_same([following], plain.generate([turn], PARAMS, use_tqdm=False))
    kv = llm.engine.scheduler.kv
    assert kv.num_held_snapshot_blocks == 0 and llm.engine.leak_report() == []


def test_drafts_under_preemption(hybrid, plain):
    """A pool too small for all six: requests verifying drafts are preempted and start
    over (their draft slots forgotten with their own), tokens unchanged."""
    prompts = random_prompts([30, 41, 25, 37, 33, 45], seed=15)
    expected = plain.generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(hybrid, num_speculative_tokens=3, num_blocks=40, block_size=8, max_model_len=96)
    drafting(llm, expected, 0.3)
    assert_same(llm.generate(prompts, PARAMS, use_tqdm=False), expected)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_accepted_tokens > 0
    assert llm.engine.leak_report() == []


def test_eagle3_drafts_and_hybrid_draft_models_are_refused(qwen3_5, model_factory):
    with pytest.raises(ConfigError, match="eagle3 drafts are not supported"):
        LLM(qwen3_5, num_speculative_tokens=2, speculative_method="eagle3",
            draft_model=str(model_factory("llama")))  # fmt: skip
    with pytest.raises(ConfigError, match="has linear-attention layers"):
        LLM(qwen3_5, num_speculative_tokens=2, speculative_method="draft_model",
            draft_model=str(qwen3_5))  # fmt: skip


def test_a_decode_worker_verifies_drafts_after_pulling_the_states(hybrid, plain):
    """Disaggregated: the decode engine pulls each prompt's KV and states, then verifies
    drafts from its own slots; tokens and log-probs (those it sampled: the first token's
    came from the prefill engine) are the colocated engine's."""
    from engine import LLMEngine
    from engine.request import RemoteKV
    from tests.engine.local_puller import LocalPuller

    prompts = random_prompts([5, 17, 33, 64], seed=6)
    expected = plain.generate(prompts, PARAMS, use_tqdm=False)
    puller = LocalPuller()
    prefill = LLMEngine(hybrid)
    decode = LLM(hybrid, num_speculative_tokens=3).engine
    decode.kv_puller = puller
    tokens = {f"r{i}": r.outputs[0].token_ids for i, r in enumerate(expected)}
    decode.scheduler.proposer = ReplayProposer(tokens, 0.3, VOCAB, seed=4)
    puller.sources["prefill-0"], puller.target = prefill, decode
    firsts = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, PARAMS, prefill_only=True)
    while prefill.has_unfinished_requests():
        firsts.update((o.request_id, o) for o in prefill.step() if o.finished)
    for i, prompt in enumerate(prompts):
        first = firsts[f"r{i}"]
        remote = RemoteKV(f"l{i}", len(prompt), tuple(first.kv_block_ids), "prefill-0",
                          state_block_ids=tuple(prefill.held_state_block_ids(f"r{i}")))  # fmt: skip
        decode.add_request(f"r{i}", prompt, PARAMS, remote_kv=remote,
                           output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    outputs = {}
    while decode.has_work():
        outputs.update((o.request_id, o) for o in decode.step() if o.finished)
    for i, reference in enumerate(expected):
        got = outputs[f"r{i}"].outputs[0]
        assert got.token_ids == reference.outputs[0].token_ids
        sampled = [entry.logprob for entry in got.logprobs]
        assert sampled == pytest.approx(sampled_logprobs(reference)[1:], abs=1e-4)
    assert decode.num_pull_failures == 0 and decode.scheduler.num_accepted_tokens > 0
    for i in range(len(prompts)):
        assert prefill.release_kv(f"r{i}")
    assert prefill.leak_report() == [] and decode.leak_report() == []


def test_a_dense_draft_model_drafts_for_a_hybrid_target(hybrid, plain, model_factory):
    """``speculative_method: draft_model`` with a dense draft of the same token ids: its
    drafts are verified like any (it keeps KV only, in the target's block ids)."""
    prompts = random_prompts([5, 33], seed=9)
    expected = plain.generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(hybrid, num_speculative_tokens=3, speculative_method="draft_model",
              draft_model=str(model_factory("llama")))  # fmt: skip
    assert_same(llm.generate(prompts, PARAMS, use_tqdm=False), expected)
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert llm.engine.leak_report() == []


class ReferenceQwenMtp(ReferenceMtp):
    """Qwen3.5's MTP layer computed with transformers, as ``ReferenceMtp`` does DeepSeek's:
    the layer (``mtp.layers.0``) as a one-layer Qwen3.5 of full attention with
    ``mtp.norm`` as its final norm and the model's embeddings and head, fed
    ``fc([pre_fc_norm_embedding(embed(t_{q+1})), pre_fc_norm_hidden(h_q)])`` (Qwen3.5's
    norms scale by 1 + weight), ``h_q`` the target's states after its final norm."""

    def __init__(self, model_dir: Path, tmp_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = json.loads((model_dir / "config.json").read_text())
        self.eps = config["rms_norm_eps"]
        tensors = load_file(str(model_dir / "model.safetensors"))
        self.enorm = 1 + tensors["mtp.pre_fc_norm_embedding.weight"]
        self.hnorm = 1 + tensors["mtp.pre_fc_norm_hidden.weight"]
        self.eh_proj = tensors["mtp.fc.weight"]
        self.embed = tensors["model.embed_tokens.weight"]
        one_layer = {f"model.layers.0.{k.removeprefix('mtp.layers.0.')}": v
                     for k, v in tensors.items() if k.startswith("mtp.layers.0.")}  # fmt: skip
        one_layer["model.norm.weight"] = tensors["mtp.norm.weight"]
        one_layer["model.embed_tokens.weight"] = self.embed
        one_layer["lm_head.weight"] = tensors["lm_head.weight"]
        layer_dir = tmp_path / "mtp-as-a-model"
        layer_dir.mkdir()
        small = {**config, "num_hidden_layers": 1, "layer_types": ["full_attention"]}
        del small["mtp_num_hidden_layers"]
        (layer_dir / "config.json").write_text(json.dumps(small))
        save_file(one_layer, str(layer_dir / "model.safetensors"), metadata={"format": "pt"})
        self.target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.layer = AutoModelForCausalLM.from_pretrained(layer_dir, dtype=torch.float32)


def test_mtp_drafts_equal_the_reference_layer(qwen3_5, tmp_path):
    """Qwen3.5's MTP layer (``mtp.*`` in its files): two drafts after every step of three
    requests (prompts in 32-token chunks, then again from the prefix cache's snapshots),
    each the reference's greedy draft at the same point; the target verifies them."""
    model_dir = add_qwen_mtp_layer(qwen3_5, tmp_path / "with-mtp")
    reference = ReferenceQwenMtp(model_dir, tmp_path)
    prompts = random_prompts((40, 75, 100), seed=11)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    config = EngineConfig(speculative_method="mtp", dtype="float32", num_speculative_tokens=2,
                          max_num_batched_tokens=32)  # fmt: skip
    engine = LLMEngine(model_dir, config)
    assert checked_drafts(engine, prompts, params, reference.drafts) >= 20
    assert engine.scheduler.num_state_restores > 0  # the second round's, from snapshots
    assert engine.leak_report() == []


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_an_oracle_mtp_layer_has_every_draft_kept(model_factory, tmp_path, arch):
    """Every block's output zeroed (the delta-rule layers' too), so the model is a bigram
    table, and an MTP layer that passes the next token's embedding to the model's norm
    and head: it predicts what the model will sample, so every draft is kept, 1 + 3
    tokens a step; the tokens and log-probs are the engine's without drafts. Qwen3-Next
    stores its MTP layer as Qwen3.5 does (an MoE layer there)."""
    with_mtp = add_qwen_mtp_layer(model_factory(arch), tmp_path / "with-mtp")
    model_dir = oracle_qwen_mtp_checkpoint(with_mtp, tmp_path / "oracle")
    prompts = random_prompts([5, 17, 33], seed=12)
    expected = LLM(model_dir, enable_prefix_caching=False).generate(prompts, PARAMS,
                                                                    use_tqdm=False)  # fmt: skip
    llm = LLM(model_dir, num_speculative_tokens=3, speculative_method="mtp")
    assert_same(llm.generate(prompts, PARAMS, use_tqdm=False), expected)
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens > 0
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("budget", [None, 6])
def test_fewer_draft_groups_than_requests(hybrid, plain, budget):
    """``max_num_verifying_seqs=1``: the pool keeps one group of draft slots, not one per
    request (3 slots past the 64 requests', not 192). Four requests decode together; in
    each step at most one verifies drafts, the others decode one token; a request holds
    the group from its verifying step until its next step has taken the kept token's
    states, and lets it go when that step verifies nothing (under a step budget of 6
    tokens, some decodes wait a step while holding it). Tokens and log-probs are the
    engine's without drafts; no group is left held."""
    prompts = random_prompts([5, 17, 33, 64], seed=4)
    expected = plain.generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(hybrid, num_speculative_tokens=3, max_num_verifying_seqs=1,
              max_num_batched_tokens=budget or 2048)  # fmt: skip
    shard = llm.engine.runner.shard
    assert shard.num_state_slots == shard.num_request_slots + 3
    drafting(llm, expected, 0.3)
    scheduler = llm.engine.scheduler
    schedule, steps = scheduler.schedule, []

    def recorded():
        out = schedule()
        decodes = [s for s in out.scheduled if s.request.num_output_tokens]
        steps.append((len(decodes), sum(1 for s in decodes if s.draft_token_ids)))
        return out

    scheduler.schedule = recorded
    assert_same(llm.generate(prompts, PARAMS, use_tqdm=False), expected)
    assert max(verifying for _, verifying in steps) == 1
    assert any(decodes > 1 and verifying == 1 for decodes, verifying in steps)
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert llm.engine.runner.draft_groups.num_used == 0
    assert llm.engine.leak_report() == []


def test_a_request_that_waits_a_step_keeps_its_draft_group(hybrid, plain):
    """Under priority scheduling, high-priority prompts arriving every few steps take the
    step's budget first: a decode that verified drafts can wait a step or more before
    its next one takes its kept token's states from its group. Meanwhile the group stays
    its own, though another decode is scheduled and would verify drafts if the group
    were free (one group here). Tokens and log-probs are the engine's without drafts."""
    prompts = random_prompts([17, 33], seed=5)
    urgent = random_prompts([15] * 6, seed=6)
    expected = plain.generate(prompts + urgent, PARAMS, use_tqdm=False)
    config = EngineConfig(num_speculative_tokens=3, max_num_verifying_seqs=1,
                          scheduling_policy="priority", max_num_batched_tokens=9,
                          prefill_chunk_tokens=7)  # fmt: skip
    engine = LLMEngine(hybrid, config)
    references = {f"r{i}": e.outputs[0].token_ids for i, e in enumerate(expected[:2])}
    engine.scheduler.proposer = ReplayProposer(references, 0.3, VOCAB)
    groups, schedule = engine.runner.draft_groups, engine.scheduler.schedule
    waited = 0  # steps in which a request holding the group was not scheduled

    def recorded():
        nonlocal waited
        out = schedule()
        scheduled = {s.request.request_id for s in out.scheduled}
        waited += any(groups.slot(r) is not None and r not in scheduled for r in references)
        return out

    engine.scheduler.schedule = recorded
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS, priority=1)
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        if step % 6 == 5 and step // 6 < len(urgent):
            engine.add_request(f"u{step // 6}", urgent[step // 6], PARAMS, priority=0)
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    ids = [f"r{i}" for i in range(2)] + [f"u{i}" for i in range(len(urgent))]
    assert_same([outputs[i] for i in ids], expected)
    assert waited > 0 and engine.scheduler.num_accepted_tokens > 0
    assert groups.num_used == 0 and engine.leak_report() == []
