"""The scheduler without a model: budgets, chunking, FCFS, preemption, remote-KV waiting."""

from __future__ import annotations

import pytest

from common.engine_config import EngineConfig
from engine.request import RemoteKV, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make_request(request_id: str, num_tokens: int, max_tokens: int = 4, start: int = 0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(start, start + num_tokens)),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=frozenset(),
        max_model_len=4096,
    )


def run_step(scheduler: Scheduler, token_id: int = 7) -> dict[str, int]:
    """Schedule one step and feed back a fixed token for every sampling request."""
    out = scheduler.schedule()
    sampled = {s.request.request_id: [(token_id, None)] for s in out.scheduled if s.samples}
    scheduler.update_from_output(out, sampled)
    return {s.request.request_id: s.num_scheduled_tokens for s in out.scheduled}


def drain(scheduler: Scheduler, max_steps: int = 1000) -> int:
    steps = 0
    while scheduler.num_unfinished and steps < max_steps:
        run_step(scheduler)
        steps += 1
    assert scheduler.num_unfinished == 0
    return steps


def test_token_budget_and_chunked_prefill():
    config = EngineConfig(block_size=4, max_num_batched_tokens=10)
    scheduler = Scheduler(config, num_blocks=64)
    scheduler.add_request(make_request("a", 25))
    scheduler.add_request(make_request("b", 3, start=100))
    assert run_step(scheduler) == {"a": 10}
    assert run_step(scheduler) == {"a": 10}
    # a's last 5 prompt tokens, then b's whole prompt within the remaining budget.
    assert run_step(scheduler) == {"a": 5, "b": 3}
    # Both decode one token per step now.
    assert run_step(scheduler) == {"a": 1, "b": 1}
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_prefill_chunk_limit():
    config = EngineConfig(block_size=4, prefill_chunk_tokens=7)
    scheduler = Scheduler(config, num_blocks=64)
    scheduler.add_request(make_request("a", 20))
    assert [run_step(scheduler)["a"] for _ in range(3)] == [7, 7, 6]
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_a_prompt_being_prefilled_takes_the_blocks_another_computed_since():
    """Two requests with one 40-token prompt (blocks of 4, chunks of 8, 11 tokens a step).
    The second is admitted behind the first and ends its chunk mid-block; once the block
    after its own is cached, it fills its block and stops there, and then takes every
    block the first computed since instead of computing them again."""
    config = EngineConfig(block_size=4, max_num_batched_tokens=11, prefill_chunk_tokens=8)
    scheduler = Scheduler(config, num_blocks=64)
    a, b = make_request("a", 40), make_request("b", 40)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert run_step(scheduler) == {"a": 8, "b": 3}  # b found a's 2 blocks: 8 .. 11
    assert b.num_computed_tokens == 11 and b.num_cached_tokens == 8
    # a computes 8 .. 16; b only fills its block (11 .. 12): a's block 12 .. 16 follows.
    assert run_step(scheduler) == {"a": 8, "b": 1}
    # b takes a's blocks 12 .. 24 (16 .. 24 scheduled by a in this very step), then 3 more.
    assert run_step(scheduler) == {"a": 8, "b": 3}
    assert b.num_computed_tokens == 27 and b.num_cached_tokens == 20
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_max_num_seqs_and_fcfs():
    config = EngineConfig(block_size=4, max_num_seqs=2)
    scheduler = Scheduler(config, num_blocks=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 5, start=10 * i))
    assert set(run_step(scheduler)) == {"r0", "r1"}
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_preemption_by_recompute_frees_and_resumes():
    # 6 blocks of 4 tokens; two requests of 9 tokens + 8 outputs need 5 blocks each.
    config = EngineConfig(block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(config, num_blocks=6)
    a, b = make_request("a", 9, max_tokens=8), make_request("b", 9, max_tokens=8, start=50)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted = []
    for _ in range(100):
        out = scheduler.schedule()
        preempted += out.preempted_ids
        sampled = {s.request.request_id: [(7, None)] for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, sampled)
        if not scheduler.num_unfinished:
            break
    assert preempted == ["b"]  # the later arrival yields
    assert b.num_preemptions == 1
    assert a.status is RequestStatus.FINISHED_LENGTH and b.status is RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert scheduler.leak_report() == []


def test_abort_frees_everything():
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=16)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10, start=20))
    run_step(scheduler)
    scheduler.abort_request("a")
    scheduler.abort_request("b")
    assert scheduler.abort_request("missing") is None
    assert scheduler.leak_report() == []


def test_remote_kv_pull_does_not_block_others():
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=16)
    remote = make_request("remote", 10)
    remote.output_token_ids.append(99)  # the first token came from the prefill worker
    remote.remote_kv = RemoteKV("lease-1", 10, (7, 8, 9))
    scheduler.add_request(remote)
    scheduler.add_request(make_request("local", 5, start=30))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["local"]
    (order,) = out.fetches
    assert order.remote_block_ids == [7, 8, 9] and len(order.local_block_ids) == 3
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KV
    scheduler.update_from_output(out, {"local": [(7, None)]})
    scheduler.finish_fetch("remote", ok=True)
    # Only the first token is computed: the prompt's KV arrived.
    assert run_step(scheduler) == {"local": 1, "remote": 1}
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_remote_kv_reuses_local_prefix_and_abort_waits_for_the_pull():
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=16)
    scheduler.add_request(make_request("local", 9))
    drain(scheduler)
    remote = make_request("remote", 10)
    remote.output_token_ids.append(99)
    remote.remote_kv = RemoteKV("lease-2", 10, (4, 5, 6))
    scheduler.add_request(remote)
    (order,) = scheduler.schedule().fetches
    assert order.remote_block_ids == [6]  # blocks 0 and 1 were cached locally
    assert scheduler.num_blocks_reused_for_remote == 2
    scheduler.abort_request("remote")
    # Aborted, but its blocks stay reserved until the pull that writes them has ended.
    assert "request remote still pulling KV" in scheduler.leak_report()
    scheduler.finish_fetch("remote", ok=True)
    assert scheduler.leak_report() == []


def remote_request(request_id: str, num_tokens: int, block_ids: tuple[int, ...]) -> Request:
    request = make_request(request_id, num_tokens)
    request.output_token_ids.append(99)  # the first token came from the prefill worker
    request.remote_kv = RemoteKV(f"lease-{request_id}", num_tokens, block_ids)
    return request


@pytest.mark.parametrize("aborted", [False, True])
def test_a_late_pull_failure_quarantines_its_pulled_blocks_until_released(aborted):
    """Failed late (its transport may still write them), the pulled blocks stay allocated
    to no one, and out of the free pool, while the request recomputes with fresh ones
    (or is gone, aborted meanwhile); released, they go back to the free pool."""
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=8)
    scheduler.add_request(make_request("local", 5))
    drain(scheduler)  # its first block is cached: the pull reuses it
    scheduler.add_request(remote_request("remote", 10, (4, 5, 6)))
    (order,) = scheduler.schedule().fetches
    pulled = set(order.local_block_ids)
    assert order.remote_block_ids == [5, 6] and len(pulled) == 2
    if aborted:
        scheduler.abort_request("remote")
    scheduler.finish_fetch("remote", ok=False, late=True)
    assert scheduler.kv.num_quarantined_blocks == 2 and scheduler.has_work
    assert "2 blocks quarantined for late pull lease-remote" in scheduler.leak_report()
    assert scheduler.kv.num_free_blocks == 8 - 2
    scheduler.add_request(make_request("filler", 20, start=100))  # 6 blocks with its token
    while scheduler.num_unfinished:
        run_step(scheduler)
        in_use = {b for ids in scheduler.kv.req_to_block_ids.values() for b in ids}
        assert not in_use & pulled
    assert scheduler.release_quarantine("lease-remote") == 2
    assert scheduler.release_quarantine("lease-remote") == 0
    assert not scheduler.has_work and scheduler.leak_report() == []
    assert scheduler.kv.num_free_blocks == 8


def test_a_prompt_being_pulled_is_pulled_once():
    # Three choices of one prompt (n=3) and an unrelated pulled prompt behind them.
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=32)
    choices = [remote_request(f"c{i}", 10, (10 * i, 10 * i + 1, 10 * i + 2)) for i in range(3)]
    for choice in choices:
        scheduler.add_request(choice)
    other = remote_request("other", 6, (40, 41))
    other.prompt_token_ids = list(range(200, 206))
    scheduler.add_request(other)
    out = scheduler.schedule()
    # c0 pulls everything; c1 and c2 wait for it without holding up the line.
    assert [(f.request.request_id, f.remote_block_ids) for f in out.fetches] == [
        ("c0", [0, 1, 2]),
        ("other", [40, 41]),
    ]
    assert choices[1].status is RequestStatus.WAITING and len(scheduler.waiting) == 2
    scheduler.update_from_output(out, {})
    assert scheduler.schedule().fetches == []  # still in flight: nothing new
    scheduler.finish_fetch("c0", ok=True)
    scheduler.finish_fetch("other", ok=True)
    out = scheduler.schedule()
    # The two full blocks are cached now: each pulls only its own partial last block.
    assert [(f.request.request_id, f.remote_block_ids) for f in out.fetches] == [
        ("c1", [12]),
        ("c2", [22]),
    ]
    c0_blocks = scheduler.kv.get_block_ids("c0")
    assert scheduler.kv.get_block_ids("c1")[:2] == c0_blocks[:2]  # shared, not copied
    scheduler.update_from_output(out, {s.request.request_id: [(7, None)] for s in out.scheduled})
    scheduler.finish_fetch("c1", ok=True)
    scheduler.finish_fetch("c2", ok=True)
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_prompts_waiting_for_a_pull_are_not_looked_up_again_every_step(monkeypatch):
    """Their cached prefixes were walked every step while the pull ran (5 ms a step at
    256 waiting on a 192-block prompt); the block they wait for says enough until it
    lands."""
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=64)
    for i in range(4):
        scheduler.add_request(remote_request(f"c{i}", 10, (10 * i, 10 * i + 1, 10 * i + 2)))
    scheduler.update_from_output(scheduler.schedule(), {})  # c0 pulls, the others wait
    looked_up: list[str] = []
    lookup = scheduler.kv.get_computed_blocks

    def counted(request):
        looked_up.append(request.request_id)
        return lookup(request)

    monkeypatch.setattr(scheduler.kv, "get_computed_blocks", counted)
    for _ in range(5):
        out = scheduler.schedule()
        assert out.fetches == [] and len(scheduler.waiting) == 3
        scheduler.update_from_output(out, {})
    assert looked_up == []
    scheduler.finish_fetch("c0", ok=True)
    out = scheduler.schedule()  # landed: each looks again and pulls its own last block
    assert [(f.request.request_id, f.remote_block_ids) for f in out.fetches] == [
        (f"c{i}", [10 * i + 2]) for i in (1, 2, 3)
    ]
    scheduler.update_from_output(out, {s.request.request_id: [(7, None)] for s in out.scheduled})
    for i in (1, 2, 3):
        scheduler.finish_fetch(f"c{i}", ok=True)
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_without_prefix_caching_a_shared_prompt_is_pulled_by_each_at_once():
    """Nothing a pull lands is cached for the others to share: waiting for it only
    delayed each choice's own whole pull."""
    scheduler = Scheduler(EngineConfig(block_size=4, enable_prefix_caching=False), num_blocks=32)
    for i in range(3):
        scheduler.add_request(remote_request(f"c{i}", 10, (10 * i, 10 * i + 1, 10 * i + 2)))
    out = scheduler.schedule()
    assert [(f.request.request_id, f.remote_block_ids) for f in out.fetches] == [
        (f"c{i}", [10 * i, 10 * i + 1, 10 * i + 2]) for i in range(3)
    ]
    scheduler.update_from_output(out, {})
    for i in range(3):
        scheduler.finish_fetch(f"c{i}", ok=True)
    drain(scheduler)
    assert scheduler.leak_report() == []


@pytest.mark.parametrize("recompute", [False, True])
def test_a_failed_pull_releases_its_followers(recompute):
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=32)
    first, second = remote_request("a", 10, (0, 1, 2)), remote_request("b", 10, (5, 6, 7))
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [f.request.request_id for f in out.fetches] == ["a"]
    scheduler.update_from_output(out, {})
    scheduler.finish_fetch("a", ok=False, recompute_on_failure=recompute)
    out = scheduler.schedule()
    # Failed for good, a leaves nothing cached: b pulls all of it. Recomputed, a's prompt
    # is computed (and its full blocks cached) in this very step: b pulls its last one.
    expected = [5, 6, 7] if not recompute else [7]
    assert [(f.request.request_id, f.remote_block_ids) for f in out.fetches] == [("b", expected)]
    scheduler.update_from_output(out, {s.request.request_id: [(7, None)] for s in out.scheduled})
    scheduler.finish_fetch("b", ok=True)
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_prefill_only_holds_blocks_until_released():
    scheduler = Scheduler(EngineConfig(block_size=4), num_blocks=16)
    request = make_request("p", 10, max_tokens=16)
    request.prefill_only = True
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.status is RequestStatus.FINISHED_PREFILLED
    assert scheduler.num_unfinished == 0 and "p" in scheduler.held
    assert len(scheduler.kv.get_block_ids("p")) == 3
    assert scheduler.release_held("p") and not scheduler.release_held("p")
    assert scheduler.leak_report() == []


def test_draft_lookahead_slots_only_where_the_pool_has_room():
    """With MTP drafts (k = 3) a decoding request also holds slots for the 2 further
    drafts' positions, within what it may still generate; in a full pool it decodes
    without them, and preempts nobody for them."""
    config = EngineConfig(block_size=4, speculative_method="mtp", num_speculative_tokens=3)
    scheduler = Scheduler(config, num_blocks=64)
    scheduler.add_request(make_request("a", 6, max_tokens=10))
    run_step(scheduler)  # the prompt (2 blocks), and its first token
    run_step(scheduler)  # position 6 decodes; 7 and 8 ahead: a third block
    assert len(scheduler.kv.block_ids_view("a")) == 3
    drain(scheduler)
    assert scheduler.leak_report() == []

    full = Scheduler(config, num_blocks=4)
    full.add_request(make_request("a", 7, max_tokens=3))
    full.add_request(make_request("b", 7, max_tokens=3, start=50))
    run_step(full)  # both prompts: the 4 blocks
    # Position 7 fits each request's second block; the look-ahead (8) would need a fifth.
    assert run_step(full) == {"a": 1, "b": 1}
    assert [len(full.kv.block_ids_view(r)) for r in "ab"] == [2, 2]
    assert full.num_preemptions == 0
    drain(full)
    assert full.leak_report() == []
