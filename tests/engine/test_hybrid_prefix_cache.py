"""A hybrid model's prefix cache: a cached prefix serves only where a snapshot of the
linear-attention states after it is cached too (``engine/kv_cache_manager.py``). Each
test compares against the same engine without the prefix cache, token for token, and
ends with nothing leaked (blocks, snapshots held, state slots)."""

from __future__ import annotations

import pytest

from common.engine_config import EngineConfig
from common.hashing import state_block_hashes
from common.kv_events import BlockRemoved, BlockStored, StateRemoved, StateStored
from engine import LLM, SamplingParams
from engine.kv_events import KVEventCollector
from engine.llm_engine import LLMEngine
from tests.engine.helpers import random_prompts, sampled_logprobs

GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
# The tiny model's greedy tokens barely depend on the states (they survived wrong ones):
# its log-probs do.
WITH_LOGPROBS = SamplingParams(max_tokens=12, min_tokens=12, temperature=0, logprobs=0)


@pytest.fixture(scope="module")
def uncached(hybrid):
    return LLM(hybrid, enable_prefix_caching=False)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def num_snapshots(llm: LLM) -> int:
    engine = llm.engine
    return len(engine.scheduler.kv.pool.state_blocks) // engine.runner.shard.blocks_per_slot


@pytest.mark.parametrize("chunk", [None, 24])
def test_a_repeated_prompt_and_a_next_turn_start_from_the_snapshot(hybrid, uncached, chunk):
    """A 70-token prompt leaves a snapshot after its 64th token (the last block boundary
    before its last token; a chunk of 24 is cut there), and its decode one after the
    80th (prompt and answer). The same prompt again starts from the first (64 tokens
    cached), a chat's next turn (the prompt, its answer, more) from the second (80);
    the tokens and log-probs are the uncached engine's."""
    llm = LLM(hybrid, prefill_chunk_tokens=chunk)
    prompt = random_prompts([70], seed=11)[0]
    first = llm.generate([prompt], WITH_LOGPROBS, use_tqdm=False)[0]
    answer = first.outputs[0].token_ids
    assert [answer] == tokens(uncached, [prompt])
    assert num_snapshots(llm) == 2
    again = llm.generate([prompt], WITH_LOGPROBS, use_tqdm=False)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == answer
    assert sampled_logprobs(again) == pytest.approx(sampled_logprobs(first), abs=1e-4)
    turn = prompt + answer + random_prompts([10], seed=12)[0]  # 92 tokens
    following = llm.generate([turn], WITH_LOGPROBS, use_tqdm=False)[0]
    assert following.num_cached_tokens == 80
    computed = uncached.generate([turn], WITH_LOGPROBS, use_tqdm=False)[0]
    assert following.outputs[0].token_ids == computed.outputs[0].token_ids
    assert sampled_logprobs(following) == pytest.approx(sampled_logprobs(computed), abs=1e-4)
    assert num_snapshots(llm) == 3  # and its decode's, after 96 tokens
    assert llm.engine.leak_report() == []


def test_equal_prompts_at_once_and_mixed_batches_keep_their_tokens(hybrid, uncached):
    """The same prompt four times in one batch (only one snapshot is kept; the others'
    copies are plain blocks again), beside prompts that share a prefix with it, in small
    steps that mix prompt chunks, restores and decodes."""
    base = random_prompts([50], seed=13)[0]
    prompts = [base] * 4 + [base[:40] + p for p in random_prompts([7, 30], seed=14)]
    llm = LLM(hybrid, prefill_chunk_tokens=16, max_num_batched_tokens=40)
    expected = tokens(uncached, prompts)
    assert tokens(llm, prompts) == expected
    assert tokens(llm, prompts[::-1]) == expected[::-1]  # now mostly from snapshots
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("tier_blocks", [0, 60])
def test_snapshots_are_evicted_and_preempted_requests_restart_from_theirs(
    hybrid, uncached, tier_blocks
):
    """A small pool (a snapshot takes 8 blocks of 8 tokens here, a request ~9): six
    requests at once preempt one another (the snapshots they hold go first); then one at
    a time, twice, the second time in reverse, where the LRU kept the last ones'
    snapshots (or a CPU tier of 60 blocks kept more, whose prefixes and snapshots come
    back from there). Tokens stay the uncached engine's; observers (KV events, the
    router's index) never see a snapshot's blocks, only whole snapshots, named by the
    block they follow, announced once each time one is cached and once when it breaks."""
    stored, evicted = [], []
    states: dict[bytes, int] = {}  # follows → times announced, less times withdrawn

    class Recorder:
        def on_blocks_stored(self, blocks, parent_hash, token_ids, block_size):
            stored.extend(block.block_hash for block in blocks)

        def on_block_evicted(self, block, block_hash):
            evicted.append(block_hash)

        def on_all_cleared(self, block_hashes):
            pass

        def on_states_stored(self, follows):
            for block_hash in follows:
                assert states.get(block_hash, 0) == 0, "announced twice"
                states[block_hash] = 1

        def on_states_removed(self, follows):
            for block_hash in follows:
                assert states.pop(block_hash) == 1, "withdrawn without being announced"

    config = EngineConfig(num_blocks=40, block_size=8, max_model_len=96)
    engine = LLMEngine(hybrid, config, observers=[Recorder()])
    if tier_blocks:
        tier_bytes = tier_blocks * engine.runner.shard.bytes_per_block
        config = config.replace(cpu_offload_bytes=tier_bytes)
        engine = LLMEngine(hybrid, config, observers=[Recorder()])
    scheduler = engine.scheduler
    prompts = random_prompts([30, 41, 25, 37, 33, 45], seed=15)
    params = SamplingParams(max_tokens=30, min_tokens=30, temperature=0)
    expected = tokens(uncached, prompts, params)

    def run(request_ids: list[str]) -> list[list[int]]:
        for request_id in request_ids:
            engine.add_request(request_id, prompts[int(request_id[-1])], params)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        return [outputs[request_id].outputs[0].token_ids for request_id in request_ids]

    assert run([f"at-once-{i}" for i in range(6)]) == expected
    assert scheduler.num_preemptions > 0
    assert [run([f"alone-{i}"])[0] for i in range(6)] == expected
    assert [run([f"back-{i}"])[0] for i in reversed(range(6))] == expected[::-1]
    assert scheduler.num_state_restores > 0
    if tier_blocks:
        assert scheduler.num_state_loads > 0 and engine.cpu_tier.stats.evicted_blocks > 0
    pool = scheduler.kv.pool
    assert pool.num_evictions > 0
    snapshot_names = set(pool.state_blocks)
    assert snapshot_names and not snapshot_names & (set(stored) | set(evicted))
    assert set(evicted) <= set(stored)
    # What observers were told is what the pool holds whole: each snapshot's every name.
    assert states and set(states) <= set(stored)
    assert set(states) == whole_snapshots(engine, set(stored))
    assert engine.leak_report() == []


def test_a_rolling_snapshot_found_in_the_step_that_rewrites_it_is_copied_first(hybrid, uncached):
    """A decoding request's rolling snapshot moves to each block boundary it reaches, in
    the same blocks. A higher-priority request admitted in the very step that moves it
    (before the decode is scheduled) found it under its old name: it copies it before
    the step writes the new one, so it starts from the right states."""
    engine = LLMEngine(hybrid, EngineConfig(scheduling_policy="priority"))
    prompt = random_prompts([20], seed=16)[0]
    params = SamplingParams(max_tokens=70, min_tokens=70, temperature=0)  # to 89 tokens
    engine.add_request("decoding", prompt, params, priority=1)
    done = {}
    while engine.scheduler.requests["decoding"].num_computed_tokens < 47:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    decoding = engine.scheduler.requests["decoding"]
    assert engine.scheduler.kv.has_snapshot(decoding, 32)  # its rolling one, for now
    # held: the prompt's (after 16 tokens) and the rolling one; let go under pressure
    kv, num_state_blocks = engine.scheduler.kv, engine.runner.shard.blocks_per_slot
    assert kv.num_held_snapshot_blocks == 2 * num_state_blocks
    turn = (prompt + decoding.output_token_ids)[:40] + random_prompts([5], seed=17)[0]
    engine.add_request("turn", turn, WITH_LOGPROBS, priority=0)
    done.update((o.request_id, o) for o in engine.step() if o.finished)  # moves it to 48
    assert engine.scheduler.num_state_restores == 1
    assert engine.scheduler.kv.has_snapshot(decoding, 48)
    assert not engine.scheduler.kv.has_snapshot(decoding, 32)
    # Let go (as under pressure): they stay cached; the next boundary takes new blocks,
    # and the one after reuses those (one rolling snapshot held, not one per boundary).
    assert kv.release_held_snapshots() and kv.num_held_snapshot_blocks == 0
    while decoding.num_computed_tokens < 81 and "decoding" not in done:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert kv.has_snapshot(decoding, 48) and kv.has_snapshot(decoding, 80)
    assert not kv.has_snapshot(decoding, 64)  # moved on, in the same blocks
    assert kv.num_held_snapshot_blocks == num_state_blocks
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done["turn"].num_cached_tokens == 32
    computed = uncached.generate([turn], WITH_LOGPROBS, use_tqdm=False)[0]
    assert done["turn"].outputs[0].token_ids == computed.outputs[0].token_ids
    assert sampled_logprobs(done["turn"]) == pytest.approx(sampled_logprobs(computed), abs=1e-4)
    assert done["decoding"].outputs[0].token_ids == tokens(uncached, [prompt], params)[0]
    assert kv.num_held_snapshot_blocks == 0 and engine.leak_report() == []


def test_a_rolling_snapshot_with_no_room_for_the_next_stays_the_requests(hybrid):
    """A let-go rolling snapshot was dropped from its request's snapshots before the
    check for room for the next one: with none, the request forgot it, and its free
    no longer put it back in the LRU right before the blocks it follows."""
    engine = LLMEngine(hybrid, EngineConfig())
    params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0)
    engine.add_request("decoding", random_prompts([20], seed=16)[0], params)
    while engine.scheduler.requests["decoding"].num_computed_tokens < 33:
        engine.step()
    kv, decoding = engine.scheduler.kv, engine.scheduler.requests["decoding"]
    assert kv.release_held_snapshots()  # let go: cached, held by no one
    rolling = kv._rolling("decoding")
    assert rolling is not None and not rolling.blocks
    taken = kv.pool.allocate(kv.pool.num_free_blocks)  # no room for the next one
    assert kv.take_snapshot_blocks(decoding, 48, rolling=True) is None
    assert kv._rolling("decoding") is rolling
    kv.pool.free(taken)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.leak_report() == []


@pytest.mark.parametrize("chunk", [None, 20])
def test_a_shared_system_prompt_is_snapshotted_where_a_second_request_branches(
    hybrid, uncached, chunk
):
    """Prompts that share only a 48-token system prompt: the first leaves no snapshot
    there (its own are after 64 tokens and its answer's blocks). The second finds the
    system prompt's KV cached but no states after it, recomputes it, and snapshots its
    states at the end of what it shared (its branch point; a chunk of 20 is cut there);
    from then on each request starts from that snapshot, alone or several at once, with
    the uncached engine's tokens and log-probs."""
    llm = LLM(hybrid, prefill_chunk_tokens=chunk)
    system = random_prompts([48], seed=18)[0]
    prompts = [system + suffix for suffix in random_prompts([20, 17, 25, 22, 19], seed=19)]
    expected = uncached.generate(prompts, WITH_LOGPROBS, use_tqdm=False)
    first, second, third = (
        llm.generate([prompt], WITH_LOGPROBS, use_tqdm=False)[0] for prompt in prompts[:3]
    )
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)
    assert third.num_cached_tokens == 48
    scheduler = llm.engine.scheduler
    assert scheduler.num_state_restores == 1
    at_once = llm.generate(prompts[3:], WITH_LOGPROBS, use_tqdm=False)
    assert [output.num_cached_tokens for output in at_once] == [48, 48]
    assert scheduler.num_state_restores == 3
    for output, computed in zip([first, second, third, *at_once], expected, strict=True):
        assert output.outputs[0].token_ids == computed.outputs[0].token_ids
        assert sampled_logprobs(output) == pytest.approx(sampled_logprobs(computed), abs=1e-4)
    assert scheduler.kv.branch_points == {}
    assert llm.engine.leak_report() == []


def test_requests_that_branch_together_keep_one_snapshot(hybrid, uncached):
    """Two requests admitted in one step, both branching from a cached 32-token system
    prompt: each snapshots it, one copy is kept (the other's blocks go back as plain
    ones), and the next request sharing it starts from that one."""
    llm = LLM(hybrid)
    system = random_prompts([32], seed=20)[0]
    prompts = [system + suffix for suffix in random_prompts([20, 23, 26, 9], seed=21)]
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0)
    expected = tokens(uncached, prompts, params)
    assert tokens(llm, prompts[:1], params) == expected[:1]  # a snapshot after 48 tokens
    kv = llm.engine.scheduler.kv
    assert num_snapshots(llm) == 1
    outputs = llm.generate(prompts[1:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[1:3]
    assert [o.num_cached_tokens for o in outputs] == [0, 0]
    assert num_snapshots(llm) == 1 + 1 + 2  # the branch's once, then each one's after 48
    assert tokens(llm, prompts[3:], params) == expected[3:]
    assert llm.engine.scheduler.num_state_restores == 1
    assert kv.num_held_snapshot_blocks == 0 and llm.engine.leak_report() == []


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done[request_id]


def test_an_evicted_prefix_and_its_snapshot_come_back_from_the_cpu_tier(hybrid, uncached):
    """A small device pool with a CPU tier: a 70-token prompt's blocks and its snapshot
    (after 64 tokens) are evicted by other prompts into the tier. The same prompt again
    loads both back (64 tokens cached, none on the device) and restores its states from
    the loaded snapshot, which then stays on the device: a third time restores from
    there, loading nothing. A chat's next turn finds the first answer's snapshot in the
    tier too. Tokens and log-probs are the uncached engine's; the tier's events announce
    KV blocks only, never a snapshot's."""
    collector = KVEventCollector()
    shard = LLMEngine(hybrid, EngineConfig(num_blocks=64, max_model_len=256)).runner.shard
    config = EngineConfig(num_blocks=24 + 3 * shard.blocks_per_slot, max_model_len=256,
                          cpu_offload_bytes=200 * shard.bytes_per_block)  # fmt: skip
    engine = LLMEngine(hybrid, config, kv_events=collector)
    scheduler, tier = engine.scheduler, engine.cpu_tier
    prompt = random_prompts([70], seed=22)[0]
    first = run_one(engine, "first", prompt, WITH_LOGPROBS)
    assert first.outputs[0].token_ids == tokens(uncached, [prompt])[0]
    names = set(scheduler.kv.pool.state_blocks)
    for i, filler in enumerate(random_prompts([150, 150], seed=23)):  # evict it all
        run_one(engine, f"fill{i}", filler, GREEDY)
    assert not names & set(scheduler.kv.pool.state_blocks)
    assert names <= tier._slots.keys()
    again = run_one(engine, "again", prompt, WITH_LOGPROBS)
    assert again.num_cached_tokens == 64
    assert (scheduler.num_state_restores, scheduler.num_state_loads) == (1, 1)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert sampled_logprobs(again) == pytest.approx(sampled_logprobs(first), abs=1e-4)
    third = run_one(engine, "third", prompt, WITH_LOGPROBS)
    assert third.num_cached_tokens == 64
    assert (scheduler.num_state_restores, scheduler.num_state_loads) == (2, 1)
    assert third.outputs[0].token_ids == first.outputs[0].token_ids
    for i, filler in enumerate(random_prompts([150, 150], seed=24)):
        run_one(engine, f"refill{i}", filler, GREEDY)
    turn = prompt + first.outputs[0].token_ids + random_prompts([10], seed=25)[0]
    following = run_one(engine, "turn", turn, WITH_LOGPROBS)
    assert following.num_cached_tokens == 80  # the prompt and its answer's full blocks
    assert scheduler.num_state_loads == 2
    computed = uncached.generate([turn], WITH_LOGPROBS, use_tqdm=False)[0]
    assert following.outputs[0].token_ids == computed.outputs[0].token_ids
    assert sampled_logprobs(following) == pytest.approx(sampled_logprobs(computed), abs=1e-4)
    events = collector.drain()
    announced = {h for event in events if isinstance(event, BlockStored | BlockRemoved)
                 for h in event.block_hashes}  # fmt: skip
    assert tier._state_names and not announced & (names | tier._state_names)
    # Snapshots are announced as the blocks they follow, while whole on the device: one
    # loaded back from the tier too (registered on the device for the load).
    on_device: set[bytes] = set()
    for event in events:
        if isinstance(event, StateStored):
            assert not on_device & set(event.block_hashes)
            on_device.update(event.block_hashes)
        elif isinstance(event, StateRemoved):
            assert set(event.block_hashes) <= on_device
            on_device.difference_update(event.block_hashes)
    assert on_device and on_device == whole_snapshots(engine, announced)
    assert engine.leak_report() == []


def whole_snapshots(engine: LLMEngine, follows: set[bytes]) -> set[bytes]:
    """Which of the blocks ``follows`` a whole state snapshot follows on the device."""
    names = set(engine.scheduler.kv.pool.state_blocks)
    num_state_blocks = engine.runner.shard.blocks_per_slot
    return {h for h in follows if set(state_block_hashes(h, num_state_blocks)) <= names}


def test_a_prompt_whose_snapshot_cannot_fit_beside_it_recomputes_instead_of_waiting(qwen3_5):
    """Restoring holds the snapshot's blocks beside the prompt's: in a pool too small for
    both (7 blocks: a 90-token prompt's 6 and a 4-block snapshot), the prompt was never
    admitted, nothing ran to evict the snapshot, and under FCFS the request behind it
    waited too, for good. It recomputes now (a lone request always fits)."""
    config = EngineConfig(block_size=16, num_blocks=7, max_model_len=96)
    engine = LLMEngine(qwen3_5, config)
    assert engine.scheduler.kv.num_state_blocks == 4
    prompt = random_prompts([90], seed=31)[0]
    engine.add_request("a", prompt[:40], SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", prompt, GREEDY)  # its first 32 tokens cached, with a snapshot
    engine.add_request("c", [7, 8, 9], GREEDY)  # behind it
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(finished) == ["b", "c"]
    alone = LLM(qwen3_5, block_size=16, num_blocks=7, max_model_len=96)
    expected = alone.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert finished["b"].outputs[0].token_ids == expected
    assert engine.leak_report() == []
