"""The worker's Stats reply carries what its engine counts, field for field where the
router reads it (placement, backpressure, its per-worker gauges)."""

from __future__ import annotations

from engine.async_engine import EngineStats
from proto import pdserve_pb2 as pb
from worker.stats import StageTimer, stats_reply


def test_the_reply_carries_the_kv_counts_the_router_reads():
    stats = EngineStats(num_running=3, num_waiting=2, num_fetching=1, kv_blocks_used=40,
                        kv_blocks_free=24, kv_blocks_total=64, kv_blocks_quarantined=6)  # fmt: skip
    timer = StageTimer()
    timer.add(pb.StageTimings(queue_ms=4.0, decode_ms=10.0))
    timer.add(pb.StageTimings(queue_ms=2.0, decode_ms=20.0))
    reply = stats_reply("e1", "decode", stats, timer, draining=True)
    assert (reply.num_running, reply.num_waiting) == (3, 3)  # pulling counts as waiting
    assert (reply.kv_blocks_used, reply.kv_blocks_free, reply.kv_blocks_total) == (40, 24, 64)
    assert reply.kv_blocks_quarantined == 6  # a frozen peer's late pull holds them
    assert reply.draining and reply.requests_finished == 2
    assert (reply.mean_timings.queue_ms, reply.mean_timings.decode_ms) == (3.0, 15.0)
