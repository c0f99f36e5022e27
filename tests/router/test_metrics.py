"""Router metrics: per-worker series follow the pool (a worker that left is not exported
at its last values)."""

from __future__ import annotations

from proto import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from router.policy import Placement


def test_series_of_workers_that_left_are_dropped():
    metrics = RouterMetrics("test_metrics")
    stats = pb.StatsResponse(kv_blocks_used=7, cpu_blocks_used=3)
    metrics.observe_workers({"decode@a:1": stats, "decode@b:1": stats}, {"decode@b:1"})
    text = metrics.render().decode()
    assert 'worker="decode@a:1"' in text and 'worker="decode@b:1"' in text
    assert 'pdserve:worker_available{worker="decode@a:1"} 0.0' in text
    assert 'pdserve:worker_available{worker="decode@b:1"} 1.0' in text
    # Routing decisions too (they grew with every worker id ever seen: 200 series after
    # 50 generations of 4 workers).
    metrics.observe_placement(Placement("decode@b:1", None, 0, 0), 0.001)
    metrics.observe_placement(Placement("decode@a:1", "prefill@c:1", 0, 0), 0.001)
    assert 'worker="decode@b:1"' in metrics.render().decode()
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    text = metrics.render().decode()
    assert 'worker="decode@a:1"' in text and 'worker="decode@b:1"' not in text
    assert 'worker="prefill@c:1"' not in text
    assert 'pdserve:worker_available{worker="decode@a:1"} 1.0' in text


def test_a_worker_not_available_shows_no_load():
    """Its stats stop coming once it drains or stalls: a drained worker read as 2
    requests running for as long as it stayed listed. It comes back with its load."""
    metrics = RouterMetrics("test_unavailable_metrics")
    stats = pb.StatsResponse(num_running=2, kv_blocks_used=36)
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    assert 'pdserve:worker_requests_running{worker="decode@a:1"} 2.0' in metrics.render().decode()
    for available in (set(), set()):  # (twice: nothing left to remove the second time)
        metrics.observe_workers({"decode@a:1": stats}, available)
        text = metrics.render().decode()
        assert "worker_requests_running{" not in text and "worker_kv_blocks_used{" not in text
        assert 'pdserve:worker_available{worker="decode@a:1"} 0.0' in text
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    assert 'pdserve:worker_requests_running{worker="decode@a:1"} 2.0' in metrics.render().decode()
    metrics.observe_workers({}, set())  # gone
    assert 'worker="decode@a:1"' not in metrics.render().decode()


def test_expert_balance_gauges_show_the_workers_stats():
    metrics = RouterMetrics("test_expert_metrics")
    stats = pb.StatsResponse(expert_rebalances=3, expert_moved_slots=14, expert_imbalance=1.25)
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    text = metrics.render().decode()
    assert 'pdserve:worker_expert_imbalance{worker="decode@a:1"} 1.25' in text
    assert 'pdserve:worker_expert_moved_slots{worker="decode@a:1"} 14.0' in text


def test_kv_usage_per_worker_and_latencies_past_80_s_are_told_apart():
    """Used blocks alone cannot say "near full"; at 80 s, where the buckets stopped, a
    600 s request read as 80 s in every quantile."""
    metrics = RouterMetrics("test_kv_usage")
    stats = pb.StatsResponse(kv_blocks_used=30, kv_blocks_total=40)
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    text = metrics.render().decode()
    assert 'pdserve:worker_kv_blocks_total{worker="decode@a:1"} 40.0' in text
    assert 'pdserve:worker_kv_cache_usage{worker="decode@a:1"} 0.75' in text
    metrics.e2e.observe(600.0)
    assert 'vllm:e2e_request_latency_seconds_bucket{le="640.0",model_name="test_kv_usage"} 1.0' in (
        metrics.render().decode()
    )


def test_quarantined_blocks_are_a_worker_gauge():
    """Blocks a frozen peer's late pull may still write are out of use until it ends: an
    operator sees them per worker (a peer frozen for good keeps them)."""
    metrics = RouterMetrics("test_quarantine")
    stats = pb.StatsResponse(kv_blocks_used=9, kv_blocks_quarantined=4)
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    text = metrics.render().decode()
    assert 'pdserve:worker_kv_blocks_quarantined{worker="decode@a:1"} 4.0' in text


def test_vllm_dashboards_find_their_series():
    """What a vLLM dashboard reads beyond latencies and token counts (a docs audit found
    them missing): the request histograms (sizes, queue, prefill, decode, time per output
    token), and per worker the KV cache usage and preemptions (a counter: a worker's
    figure is cumulative). (No ``*_created`` series: the router's process turns them off,
    ``tests/deploy/test_up_hosts.py``.)"""
    metrics = RouterMetrics("m", max_model_len=4096)
    stats = pb.StatsResponse(kv_blocks_used=30, kv_blocks_total=40, num_preemptions=5)
    metrics.observe_workers({"decode@a:1": stats}, {"decode@a:1"})
    metrics.sequence_served(100, 0, 11, 0.5, 2.0)
    metrics.observe_prefill(pb.StageTimings(queue_ms=250, prefill_ms=40))
    text = metrics.render().decode()
    for line in (
        'vllm:kv_cache_usage_perc{model_name="m",worker="decode@a:1"} 0.75',
        "# TYPE vllm:num_preemptions_total counter",
        'vllm:num_preemptions_total{model_name="m",worker="decode@a:1"} 5.0',
        'vllm:request_prompt_tokens_bucket{le="50.0",model_name="m"} 0.0',
        'vllm:request_prompt_tokens_bucket{le="100.0",model_name="m"} 1.0',
        'vllm:request_generation_tokens_sum{model_name="m"} 11.0',
        'vllm:request_decode_time_seconds_sum{model_name="m"} 2.0',
        'vllm:request_time_per_output_token_seconds_sum{model_name="m"} 0.2',
        'vllm:request_queue_time_seconds_sum{model_name="m"} 0.25',
        'vllm:request_prefill_time_seconds_count{model_name="m"} 1.0',
    ):
        assert line in text, line
    assert 'le="2000.0"' in text and 'le="5000.0"' not in text  # up to max_model_len
    metrics.observe_workers({"decode@a:1": stats}, set())  # drained: no load series
    text = metrics.render().decode()
    assert "vllm:kv_cache_usage_perc{" not in text and "vllm:num_preemptions_total{" not in text
