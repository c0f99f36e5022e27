"""Prefill on one engine, decode on another: the same tokens as one engine alone."""

from __future__ import annotations

import time

import pytest

from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.request import RemoteKV
from tests.engine.helpers import random_prompts
from tests.engine.local_puller import LocalPuller


def run(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def colocated_tokens(model, config: EngineConfig, prompts, params) -> dict[str, list[int]]:
    """Request id ``r{i}`` -> its tokens from one engine doing prefill and decode."""
    engine = LLMEngine(model, config)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}


@pytest.fixture(scope="module")
def pair(tiny_llama):
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama, EngineConfig())
    decode = LLMEngine(tiny_llama, EngineConfig(), kv_puller=puller)
    puller.sources["prefill-0"] = prefill
    puller.target = decode
    return prefill, decode, puller


def hand_off(prefill: LLMEngine, decode: LLMEngine, prompts, params) -> dict:
    """Request ``r{i}`` per prompt, prefilled on ``prefill`` (prefill-only), then added to
    ``decode`` with its KV handle (source ``prefill-0``), first token and drafts (MTP's,
    if any); not yet run. Returns the prefill outputs by request id."""
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params, prefill_only=True)
    firsts = run(prefill)
    for i, prompt in enumerate(prompts):
        first = firsts[f"r{i}"]
        assert first.finished and first.outputs[0].finish_reason is None
        remote = RemoteKV(f"lease-{i}", len(prompt), tuple(first.kv_block_ids), "prefill-0")
        decode.add_request(f"r{i}", prompt, params, remote_kv=remote,
                           output_token_ids=first.outputs[0].token_ids,
                           draft_token_ids=first.draft_token_ids)  # fmt: skip
    return firsts


def disaggregated(prefill, decode, prompts, params, fail_pull=False, policy=True):
    decode.recompute_on_pull_failure = policy
    hand_off(prefill, decode, prompts, params)
    outputs = run(decode)
    for i in range(len(prompts)):
        assert prefill.release_kv(f"r{i}")
    return outputs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, min_tokens=20, temperature=0),
        SamplingParams(max_tokens=20, min_tokens=20, temperature=0.8, top_p=0.95, seed=7),
    ],
    ids=["greedy", "seeded"],
)
def test_split_equals_colocated(tiny_llama, pair, params):
    prefill, decode, puller = pair
    prompts = random_prompts(seed=5)
    colocated = LLMEngine(tiny_llama, EngineConfig())
    for i, prompt in enumerate(prompts):
        colocated.add_request(f"r{i}", prompt, params)
    expected = run(colocated)
    outputs = disaggregated(prefill, decode, prompts, params)
    for i in range(len(prompts)):
        assert outputs[f"r{i}"].outputs[0].token_ids == expected[f"r{i}"].outputs[0].token_ids
    assert puller.num_blocks_pulled > 0
    for engine in (prefill, decode, colocated):
        assert engine.leak_report() == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, min_tokens=40, temperature=0),
        SamplingParams(
            max_tokens=40,
            min_tokens=40,
            temperature=0.9,
            top_k=50,
            seed=11,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logprobs=2,
        ),
    ],
    ids=["greedy", "seeded-penalised"],
)
def test_a_sequence_resumed_elsewhere_continues_exactly(tiny_llama, params):
    """What the router's migration relies on: an engine given the prompt and the first k
    tokens another engine generated (no KV: it recomputes them) goes on with exactly the
    tokens and log-probs that engine went on with, whatever k, seeded sampling and
    penalties included (both depend on every token before)."""
    prompts = random_prompts((37, 64), seed=29)
    whole = colocated_tokens(tiny_llama, EngineConfig(), prompts, params)
    reference = LLMEngine(tiny_llama, EngineConfig())
    for i, prompt in enumerate(prompts):
        reference.add_request(f"r{i}", prompt, params)
    logprobs = {rid: out.outputs[0].logprobs for rid, out in run(reference).items()}
    resumed = LLMEngine(tiny_llama, EngineConfig(block_size=8))
    for k in (1, 5, 16, 39):
        for i, prompt in enumerate(prompts):
            resumed.add_request(f"k{k}-r{i}", prompt, params,
                                output_token_ids=whole[f"r{i}"][:k])  # fmt: skip
        for rid, out in run(resumed).items():
            original = rid.split("-")[1]
            assert out.outputs[0].token_ids == whole[original], (k, rid)
            if params.logprobs is not None:  # for the tokens it generated itself
                got = out.outputs[0].logprobs
                assert len(got) == 40 - k
                assert _same_logprobs(got, logprobs[original][k:]), (k, rid)
    assert resumed.leak_report() == [] and reference.leak_report() == []


def _same_logprobs(got, expected) -> bool:
    return [(lp.token_id, lp.rank, lp.top_token_ids) for lp in got] == [
        (lp.token_id, lp.rank, lp.top_token_ids) for lp in expected
    ] and all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got, expected, strict=True))


def test_decode_pulls_only_blocks_it_does_not_cache(pair):
    prefill, decode, puller = pair
    prefix = random_prompts((64,), seed=9)[0]
    params = SamplingParams(max_tokens=4, temperature=0)
    disaggregated(prefill, decode, [prefix + [11, 12, 13]], params)
    before = puller.num_blocks_pulled
    out = disaggregated(prefill, decode, [prefix + [21, 22, 23, 24, 25]], params)["r0"]
    # 69 prompt tokens = 5 blocks; the decode worker already caches the first 4.
    assert puller.num_blocks_pulled - before == 1 == out.num_remote_blocks_pulled
    assert out.num_cached_tokens == 64
    assert decode.leak_report() == [] and prefill.leak_report() == []


TIER_PARAMS = SamplingParams(max_tokens=4, min_tokens=4, temperature=0)


def tiered_decode(model, prefill, puller, seed: int) -> tuple[LLMEngine, list[int]]:
    """A decode engine with a small pool and a CPU tier (the puller's target now), and a
    160-token (10-block) prefix it pulled and then offloaded to the tier."""
    small = dict(num_blocks=24, max_model_len=256)  # 384 tokens of device KV
    decode = LLMEngine(model, EngineConfig(cpu_offload_bytes=64 << 20, **small),
                       kv_puller=puller)  # fmt: skip
    puller.target = decode
    prefix = random_prompts((160,), seed=seed)[0]
    disaggregated(prefill, decode, [prefix + [7]], TIER_PARAMS)
    for filler in random_prompts((200, 200), seed=seed + 1):  # push the prefix out
        decode.add_request("fill", filler, TIER_PARAMS)
        run(decode)
    return decode, prefix


def test_decode_loads_what_its_cpu_tier_holds_and_pulls_the_rest(tiny_llama, pair):
    """A prefix the decode worker pulled before and then offloaded to its CPU tier comes
    back from CPU memory; only the blocks after it cross the network. Same tokens."""
    prefill, _, puller = pair
    decode, prefix = tiered_decode(tiny_llama, prefill, puller, seed=93)
    params = TIER_PARAMS
    try:
        question = prefix + [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
        before = (puller.num_blocks_pulled, decode.cpu_tier.stats.hit_blocks)
        out = disaggregated(prefill, decode, [question], params)["r0"]
        pulled = puller.num_blocks_pulled - before[0]
        assert decode.cpu_tier.stats.hit_blocks - before[1] == 10  # the prefix, from CPU
        assert pulled == out.num_remote_blocks_pulled == 2  # 177 tokens: 12 blocks, 10 held
        assert out.num_cached_tokens == 160
        expected = colocated_tokens(tiny_llama, EngineConfig(), [question], params)["r0"]
        assert out.outputs[0].token_ids == expected
    finally:
        puller.target = pair[1]
    assert decode.leak_report() == [] and prefill.leak_report() == []


def test_a_prompt_whose_tier_load_and_pull_are_under_way_waits_for_them(tiny_llama, pair):
    """Two samples of one prompt (n=2) whose prefix the decode worker's CPU tier holds:
    the first loads the prefix and pulls the rest; the second waits for both to land
    and finds it all cached. It waited only on blocks being pulled, so it loaded the
    prefix again and pulled the rest again (twice the network for the same blocks)."""
    prefill, _, puller = pair
    decode, prefix = tiered_decode(tiny_llama, prefill, puller, seed=95)
    params = TIER_PARAMS
    try:
        question = prefix + list(range(8, 25))  # 177 tokens: 10 blocks held, 2 to pull
        before = (puller.num_blocks_pulled, decode.cpu_tier.stats.hit_blocks)
        outs = disaggregated(prefill, decode, [question, question], params)
        assert decode.cpu_tier.stats.hit_blocks - before[1] == 10  # loaded once
        # The full block pulled once; the partial last one by each (never cached): 4 before.
        assert puller.num_blocks_pulled - before[0] == 3
        assert outs["r1"].num_cached_tokens == 176
        assert outs["r0"].outputs[0].token_ids == outs["r1"].outputs[0].token_ids
    finally:
        puller.target = pair[1]
    assert decode.leak_report() == [] and prefill.leak_report() == []


def test_failed_pull_recomputes_or_fails(tiny_llama, pair, caplog):
    """Either way the failure is logged with its reason: recomputing hides a peer that
    refuses every pull (a KV layout mismatch) from the client, not from the operator."""
    prefill, decode, puller = pair
    prompts = random_prompts((40,), seed=11)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = disaggregated(prefill, decode, prompts, params)["r0"].outputs[0].token_ids
    fresh_decode = LLMEngine(tiny_llama, EngineConfig(), kv_puller=puller)
    puller.target = fresh_decode
    try:
        puller.fail_next = True
        abandoned = len(puller.abandoned)
        recomputed = disaggregated(prefill, fresh_decode, prompts, params)["r0"]
        assert recomputed.outputs[0].token_ids == expected and recomputed.error is None
        assert fresh_decode.num_pull_failures == 1
        # Nothing will read the peer's blocks: it may free them now, not at its lease's
        # end (a pair whose layouts differ held every prompt's blocks for lease_s).
        assert len(puller.abandoned) == abandoned + 1
        (warning,) = [r for r in caplog.records if r.name == "engine.llm_engine"]
        assert "peer unreachable" in warning.message and "recomputed" in warning.message
        kv = fresh_decode.scheduler.kv  # the recompute is no second lookup
        assert (kv.num_query_tokens, kv.num_hit_tokens) == (41, 0)
        puller.fail_next = True
        fresh_prompt = random_prompts((40,), seed=12)
        failed = disaggregated(prefill, fresh_decode, fresh_prompt, params, policy=False)["r0"]
        assert failed.outputs[0].finish_reason == "abort"
        assert "pulling the prompt's KV" in failed.error and "peer unreachable" in failed.error
        assert len(puller.abandoned) == abandoned + 2
    finally:
        puller.target = decode
    assert fresh_decode.leak_report() == [] and prefill.leak_report() == []


def test_abort_while_pulling_frees_after_the_pull(pair):
    prefill, decode, _ = pair
    prompt = random_prompts((50,), seed=13)[0]
    params = SamplingParams(max_tokens=8, temperature=0)
    prefill.add_request("x", prompt, params, prefill_only=True)
    first = run(prefill)["x"]
    decode.add_request(
        "x",
        prompt,
        params,
        remote_kv=RemoteKV("lease-x", len(prompt), tuple(first.kv_block_ids), "prefill-0"),
        output_token_ids=first.outputs[0].token_ids,
    )
    decode.step()  # admits it and orders the pull
    assert decode.scheduler.fetching
    aborted = decode.abort_request("x")
    assert aborted.outputs[0].finish_reason == "abort"
    assert "still pulling" in " ".join(decode.leak_report())
    run(decode)  # the pull ends; only then are the blocks freed
    assert decode.leak_report() == []
    assert prefill.release_kv("x")
    assert prefill.leak_report() == []


def test_abort_before_the_pull_abandons_the_remote_kv_and_during_it_does_not(pair):
    """Aborted before its pull started, a request tells the puller the peer may free the
    KV at once (nothing reads it; the router leaves such a lease to expire); aborted
    while pulling, it does not: the transport ends that pull and notifies the peer."""
    prefill, decode, puller = pair
    prompt = random_prompts((50,), seed=17)[0]
    params = SamplingParams(max_tokens=8, temperature=0)
    prefill.add_request("y", prompt, params, prefill_only=True)
    first = run(prefill)["y"]
    remote = RemoteKV("lease-y", len(prompt), tuple(first.kv_block_ids), "prefill-0")
    before = len(puller.abandoned)
    decode.add_request("y", prompt, params, remote_kv=remote,
                       output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    decode.abort_request("y")  # waiting: its pull never ordered
    assert puller.abandoned[before:] == ["lease-y"]
    decode.add_request("y", prompt, params, remote_kv=remote,
                       output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    decode.step()  # orders the pull
    decode.abort_request("y")
    run(decode)
    assert puller.abandoned[before:] == ["lease-y"]  # not again
    assert decode.leak_report() == []
    assert prefill.release_kv("y") and prefill.leak_report() == []


def test_a_handle_nothing_will_pull_is_given_up_at_once(pair):
    """A handle whose blocks are all cached here, or one the engine refuses (a block
    listed twice), is never pulled, so no transfer tells the peer it may free them: the
    engine gives it up at once. A router whose client left once the engine held the
    request leaves the lease to it (``proto.ADMITTED_KEY``); left to expire, it held the
    prefill worker's blocks for ``lease_s``."""
    prefill, decode, puller = pair
    block_size = decode.config.block_size
    prompt = random_prompts((2 * block_size,), seed=21)[0]  # full blocks only: all cached
    params = SamplingParams(max_tokens=4, temperature=0)
    expected = disaggregated(prefill, decode, [prompt], params)["r0"].outputs[0].token_ids
    before = (len(puller.abandoned), puller.num_blocks_pulled)
    again = disaggregated(prefill, decode, [prompt], params)["r0"]
    assert again.outputs[0].token_ids == expected and again.num_cached_tokens == len(prompt)
    assert puller.num_blocks_pulled == before[1]  # nothing pulled...
    assert puller.abandoned[before[0] :] == ["lease-0"]  # ...so given up at once
    other = random_prompts((50,), seed=22)[0]
    prefill.add_request("z", other, params, prefill_only=True)
    first = run(prefill)["z"]
    block = first.kv_block_ids[0]
    twice = RemoteKV("lease-z", len(other), (block,) * len(first.kv_block_ids), "prefill-0")
    decode.add_request("z", other, params, remote_kv=twice,
                       output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    assert puller.abandoned[before[0] :] == ["lease-0", "lease-z"]  # refused: computed here
    run(decode)
    assert prefill.release_kv("z")
    assert decode.leak_report() == [] and prefill.leak_report() == []


def test_first_token_that_finishes_needs_no_decode(pair):
    prefill, _, _ = pair
    prompt = random_prompts((20,), seed=3)[0]
    prefill.add_request("y", prompt, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    out = run(prefill)["y"]
    assert out.outputs[0].finish_reason == "length" and out.kv_block_ids is None
    assert not prefill.release_kv("y")
    assert prefill.leak_report() == []


def test_handles_that_cannot_be_served_are_refused(tiny_llama, pair):
    _, decode, _ = pair
    params = SamplingParams(max_tokens=4, temperature=0)
    limit = decode.max_model_len
    prompt = random_prompts((32,), seed=9)[0]
    handle = RemoteKV("lease-x", 32, (1, 2), "prefill-0")
    cases = [  # (prompt, output_token_ids, params, handle)
        ([5] * limit, [7], params, None),  # no room left for the first token
        ([5] * (limit - 1), [7], params, None),  # at the limit: nothing left to generate
        (prompt, [], params, handle),  # a handle without the token sampled after it
        (prompt, [7, 8], SamplingParams(max_tokens=2, temperature=0), None),  # nothing left
    ]
    for tokens, outputs, sampling, remote in cases:
        with pytest.raises(InvalidRequestError):
            decode.add_request("bad", tokens, sampling, remote_kv=remote,
                               output_token_ids=outputs)  # fmt: skip
    assert "bad" not in decode.scheduler.requests and decode.leak_report() == []


def test_a_request_preempted_after_its_pull_never_pulls_again(tiny_llama):
    """The router releases the lease once decoding starts and the prefill worker reuses
    the blocks; a preempted request must recompute, not read them again."""
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0)
    prompts = random_prompts((20, 20), seed=5)
    config = EngineConfig(max_model_len=64, num_blocks=16)
    expected = colocated_tokens(tiny_llama, config, prompts, params)

    class CountingPuller(LocalPuller):
        def __init__(self) -> None:
            super().__init__()
            self.started: list[str] = []

        def start_fetch(self, request_id, *args):
            self.started.append(request_id)
            super().start_fetch(request_id, *args)

    puller = CountingPuller()
    prefill = LLMEngine(tiny_llama, config)
    decode = LLMEngine(tiny_llama, EngineConfig(max_model_len=64, num_blocks=6), kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    hand_off(prefill, decode, prompts, params)
    released, got = set(), {}
    while decode.has_work():
        for output in decode.step():
            rid = output.request_id
            if output.new_token_ids and rid not in released:  # the router's ReleaseKV
                released.add(rid)
                assert prefill.release_kv(rid)
                for layer in prefill.runner.kv_caches:  # the blocks go to other prompts
                    layer.zero_()
            if output.finished:
                got[rid] = output.outputs[0].token_ids
    assert decode.scheduler.num_preemptions >= 1  # the 6-block pool forced one
    assert sorted(puller.started) == ["r0", "r1"]  # each pulled once
    assert got == expected
    assert decode.leak_report() == [] and prefill.leak_report() == []


@pytest.mark.parametrize("recompute", [True, False])
def test_a_handle_past_its_start_by_is_never_pulled(tiny_llama, recompute):
    """The request waited too long to be scheduled: the lease could run out mid-pull (and
    released blocks hold other prompts' KV), so it recomputes, or fails without recompute."""
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama, EngineConfig())
    decode = LLMEngine(tiny_llama, EngineConfig(), kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    decode.recompute_on_pull_failure = recompute
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    prompt = random_prompts((40,), seed=13)[0]
    colocated = LLMEngine(tiny_llama, EngineConfig())
    colocated.add_request("r", prompt, params)
    expected = run(colocated)["r"].outputs[0].token_ids
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = run(prefill)["r"]
    stale = RemoteKV("lease-r", len(prompt), tuple(first.kv_block_ids), "prefill-0",
                     start_by=time.monotonic() - 1)  # fmt: skip
    decode.add_request("r", prompt, params, remote_kv=stale,
                       output_token_ids=first.outputs[0].token_ids)  # fmt: skip
    out = run(decode)["r"]
    assert decode.num_pull_failures == 1 and puller.num_blocks_pulled == 0
    if recompute:
        assert out.outputs[0].token_ids == expected and out.error is None
    else:
        assert out.outputs[0].finish_reason == "abort" and "lease ran out" in out.error
    assert prefill.release_kv("r")
    assert decode.leak_report() == [] and prefill.leak_report() == []


@pytest.mark.timeout(120)
def test_pulled_requests_that_fill_the_pool_do_not_deadlock(tiny_llama):
    """Two pulled 32-token prompts fill a 4-block pool, and each needs a fifth block for
    its next token. Parked in the waiting queue with their blocks (as they once were),
    neither could be preempted and nothing ever ran; as running requests, one is
    preempted, recomputes later, and both finish with the colocated tokens."""
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    prompts = random_prompts((32, 32), seed=3)
    config = EngineConfig(num_blocks=4, max_model_len=64)
    expected = colocated_tokens(tiny_llama, config, prompts, params)
    puller = LocalPuller()
    prefill = LLMEngine(tiny_llama, EngineConfig(num_blocks=64, max_model_len=64))
    decode = LLMEngine(tiny_llama, config, kv_puller=puller)
    puller.sources["prefill-0"], puller.target = prefill, decode
    outputs = disaggregated(prefill, decode, prompts, params)
    assert {rid: out.outputs[0].token_ids for rid, out in outputs.items()} == expected
    assert decode.scheduler.num_preemptions >= 1
    assert decode.leak_report() == [] and prefill.leak_report() == []
