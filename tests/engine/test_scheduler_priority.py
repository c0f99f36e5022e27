"""The scheduler under ``scheduling_policy: priority``: the waiting line's order, the step's
budget going to smaller values first, and preemption of larger values for a batch slot or
blocks (never of equal ones). Each test ends with nothing leaked."""

from __future__ import annotations

from common.engine_config import EngineConfig, SchedulingPolicy
from engine.request import RemoteKV, Request, RequestStatus
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import drain, make_request, run_step

PRIORITY = SchedulingPolicy.PRIORITY


def with_priority(request: Request, priority: int) -> Request:
    request.priority = priority
    return request


def admission_order(scheduler: Scheduler, max_steps: int = 1000) -> list[str]:
    """Run to the end; the request ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            break
        for request_id in run_step(scheduler):
            if request_id not in order:
                order.append(request_id)
    assert scheduler.num_unfinished == 0
    return order


def test_waiting_line_goes_by_priority_then_arrival():
    config = EngineConfig(block_size=4, max_num_seqs=1, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=64)
    for request_id, priority in [("low", 5), ("mid-1", 1), ("high", -3), ("mid-2", 1)]:
        scheduler.add_request(with_priority(make_request(request_id, 5), priority))
    assert admission_order(scheduler) == ["high", "mid-1", "mid-2", "low"]
    assert scheduler.num_preemptions == 0
    assert scheduler.leak_report() == []


def test_fcfs_order_is_arrival():
    scheduler = Scheduler(EngineConfig(block_size=4, max_num_seqs=1), num_blocks=64)
    for request_id in ["c", "a", "b"]:
        scheduler.add_request(make_request(request_id, 5))
    assert admission_order(scheduler) == ["c", "a", "b"]
    assert scheduler.leak_report() == []


def test_preempts_a_larger_value_for_a_batch_slot():
    config = EngineConfig(block_size=4, max_num_seqs=2, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=64)
    low_a = with_priority(make_request("low-a", 5, max_tokens=6), 1)
    low_b = with_priority(make_request("low-b", 5, max_tokens=6, start=10), 1)
    scheduler.add_request(low_a)
    scheduler.add_request(low_b)
    assert run_step(scheduler) == {"low-a": 5, "low-b": 5}
    scheduler.add_request(with_priority(make_request("high", 5, start=20), 0))
    out = scheduler.schedule()
    # The latest arrival of the largest value makes room; the high one goes first.
    assert out.preempted_ids == ["low-b"]
    assert [s.request.request_id for s in out.scheduled] == ["high", "low-a"]
    assert low_b.status is RequestStatus.PREEMPTED and low_b.num_computed_tokens == 0
    scheduler.update_from_output(out, {"high": [(7, None)], "low-a": [(7, None)]})
    drain(scheduler)
    assert low_b.status is RequestStatus.FINISHED_LENGTH and low_b.num_output_tokens == 6
    assert low_b.num_preemptions == 1
    assert scheduler.leak_report() == []


def test_equal_values_never_preempt():
    config = EngineConfig(block_size=4, max_num_seqs=2, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=64)
    for index in range(2):
        scheduler.add_request(with_priority(make_request(f"r{index}", 5, start=10 * index), 1))
    run_step(scheduler)
    scheduler.add_request(with_priority(make_request("late", 5, start=50), 1))
    out = scheduler.schedule()
    assert out.preempted_ids == []
    assert {s.request.request_id for s in out.scheduled} == {"r0", "r1"}
    scheduler.update_from_output(out, {s.request.request_id: [(7, None)] for s in out.scheduled})
    drain(scheduler)
    assert scheduler.num_preemptions == 0
    assert scheduler.leak_report() == []


def test_preempts_larger_values_for_blocks_last_first():
    # 8 blocks of 4 tokens, no prefix caching: three low requests of 8 tokens take 2 each
    # (6), the high one's 17 tokens need 5, so two of them yield: the last arrival first.
    config = EngineConfig(block_size=4, enable_prefix_caching=False, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=8)
    lows = [
        with_priority(make_request(f"low-{i}", 7, max_tokens=2, start=10 * i), 2 + i % 2)
        for i in range(3)
    ]
    for request in lows:
        scheduler.add_request(request)
    run_step(scheduler)
    high = with_priority(make_request("high", 17, max_tokens=2, start=100), 0)
    scheduler.add_request(high)
    out = scheduler.schedule()
    # Values 2, 3, 2: the 3 goes first, then the later of the two 2s.
    assert out.preempted_ids == ["low-1", "low-2"]
    assert [s.request.request_id for s in out.scheduled] == ["high", "low-0"]
    scheduler.update_from_output(out, {s.request.request_id: [(7, None)] for s in out.scheduled})
    drain(scheduler)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in [*lows, high])
    assert scheduler.leak_report() == []


def test_no_preemption_that_would_not_make_room():
    # The head needs more blocks than the free ones and those of every request of a larger
    # value together: it preempts no one (that would only throw their work away), and
    # waits at the head of the line for the equal-valued one to finish.
    config = EngineConfig(block_size=4, enable_prefix_caching=False, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=6)
    keep = with_priority(make_request("keep", 12, max_tokens=3), 0)
    spare = with_priority(make_request("spare", 4, max_tokens=3, start=50), 9)
    scheduler.add_request(keep)
    scheduler.add_request(spare)
    run_step(scheduler)
    big = with_priority(make_request("big", 16, max_tokens=1, start=100), 0)
    scheduler.add_request(big)
    out = scheduler.schedule()
    assert out.preempted_ids == []
    assert [s.request.request_id for s in out.scheduled] == ["keep", "spare"]
    scheduler.update_from_output(out, {"keep": [(7, None)], "spare": [(7, None)]})
    assert admission_order(scheduler) == ["keep", "spare", "big"]
    assert scheduler.num_preemptions == 0 and big.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.leak_report() == []


def test_a_victim_is_not_readmitted_in_the_step_that_preempted_it():
    # Three blocks: "low" holds all three; "high" needs one, so "low" is preempted. The
    # two blocks left would take "low" back at once, recomputed from its first token;
    # it waits for the next step instead (as vLLM's victims do).
    config = EngineConfig(block_size=4, enable_prefix_caching=False, prefill_chunk_tokens=4,
                          scheduling_policy=PRIORITY)  # fmt: skip
    scheduler = Scheduler(config, num_blocks=3)
    low = with_priority(make_request("low", 4, max_tokens=8), 5)
    scheduler.add_request(low)
    for _ in range(6):
        run_step(scheduler)
    assert low.num_computed_tokens == 9 and scheduler.kv.num_free_blocks == 0
    scheduler.add_request(with_priority(make_request("high", 3, max_tokens=2, start=100), 0))
    out = scheduler.schedule()
    assert out.preempted_ids == ["low"]
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    scheduler.update_from_output(out, {"high": [(7, None)]})
    drain(scheduler)
    assert low.status is RequestStatus.FINISHED_LENGTH and low.num_preemptions == 1
    assert scheduler.leak_report() == []


def test_fcfs_schedules_a_landed_pull_before_readmitting_a_preempted_request():
    # W is preempted while F's pull is in flight; F lands. Running requests go first under
    # FCFS: F gets the last block, and W waits (it must not take it and make F, whose KV
    # just arrived, preempt itself).
    config = EngineConfig(block_size=4, enable_prefix_caching=False, prefill_chunk_tokens=4)
    scheduler = Scheduler(config, num_blocks=4)
    a = make_request("A", 4, max_tokens=10)
    w = make_request("W", 4, max_tokens=10, start=100)
    f = make_request("F", 4, max_tokens=10, start=200)
    f.output_token_ids.append(99)
    f.remote_kv = RemoteKV("lease", 4, (9,))
    for request in (a, w, f):
        scheduler.add_request(request)
    run_step(scheduler)  # A and W prefill; F's pull is ordered
    run_step(scheduler)  # A grows; W cannot and yields
    assert w.status is RequestStatus.PREEMPTED
    scheduler.finish_fetch("F", ok=True)
    assert run_step(scheduler) == {"A": 1, "F": 1}
    assert f.num_preemptions == 0 and w.status is RequestStatus.PREEMPTED
    drain(scheduler)  # (four blocks for three growing requests: they take turns)
    assert scheduler.leak_report() == []


def test_smaller_value_takes_the_budget_before_a_chunked_prompt():
    config = EngineConfig(block_size=4, max_num_batched_tokens=10, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=64)
    scheduler.add_request(with_priority(make_request("long", 40), 5))
    assert run_step(scheduler) == {"long": 10}
    scheduler.add_request(with_priority(make_request("short", 6, start=100), 0))
    # The short prompt first, the long one's chunk in what is left; no preemption.
    assert run_step(scheduler) == {"short": 6, "long": 4}
    assert scheduler.num_preemptions == 0
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_fcfs_keeps_running_requests_first():
    config = EngineConfig(block_size=4, max_num_batched_tokens=10)
    scheduler = Scheduler(config, num_blocks=64)
    scheduler.add_request(make_request("long", 40))
    assert run_step(scheduler) == {"long": 10}
    scheduler.add_request(make_request("short", 6, start=100))
    assert run_step(scheduler) == {"long": 10}
    drain(scheduler)
    assert scheduler.leak_report() == []


def test_a_pull_preempts_a_larger_value_on_a_decode_worker():
    config = EngineConfig(block_size=4, max_num_seqs=1, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=16)
    low = with_priority(make_request("low", 5, max_tokens=4), 3)
    scheduler.add_request(low)
    run_step(scheduler)
    remote = with_priority(make_request("remote", 10, start=40), 1)
    remote.output_token_ids.append(99)  # sampled by the prefill worker
    remote.remote_kv = RemoteKV("lease-1", 10, (7, 8, 9))
    scheduler.add_request(remote)
    out = scheduler.schedule()
    assert out.preempted_ids == ["low"]
    assert [f.request.request_id for f in out.fetches] == ["remote"]
    assert out.scheduled == []  # the preempted one waits behind the pull's slot
    scheduler.update_from_output(out, {})
    scheduler.finish_fetch("remote", ok=True)
    assert admission_order(scheduler) == ["remote", "low"]
    assert low.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.leak_report() == []


def test_abort_from_the_middle_of_the_line():
    config = EngineConfig(block_size=4, max_num_seqs=1, scheduling_policy=PRIORITY)
    scheduler = Scheduler(config, num_blocks=64)
    for request_id, priority in [("a", 0), ("b", 1), ("c", 2)]:
        scheduler.add_request(with_priority(make_request(request_id, 5), priority))
    run_step(scheduler)
    assert scheduler.abort_request("b") is not None
    assert admission_order(scheduler) == ["a", "c"]
    assert scheduler.leak_report() == []
