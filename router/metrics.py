"""Prometheus metrics: vLLM's names where they exist, ``pdserve:*`` for the rest.

Each router owns one registry (no global state), served at /metrics. A vLLM dashboard
reads what it reads there: request latencies and their parts (queue, prefill, decode,
time per output token), token counts and their histograms, running and waiting
sequences, prefix-cache queries and hits, and per worker (label ``worker``) the KV cache
usage and preemptions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from proto import pdserve_pb2 as pb
from router.policy import Placement

if TYPE_CHECKING:
    from router.live_plan import LivePlan

# Up to vLLM's longest (its e2e histogram's 7680 s): a request may run for the router's
# request_timeout_s (600 s by default), and at 80 s, where these stopped, every longer
# one read as 80 s in histogram_quantile.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0,
                    2560.0, 7680.0)  # fmt: skip
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 1e-2)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50... up to ``max_model_len`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(buckets)
            buckets.append(float(step * scale))
        scale *= 10


@dataclass(frozen=True)
class _PerWorker:
    """A gauge with a series per worker showing one figure of its last Stats; ``fixed``:
    the label values before the worker's (the model name of a vLLM-named gauge)."""

    gauge: Gauge
    value: Callable[[pb.StatsResponse], float]
    fixed: tuple[str, ...] = ()

    def set(self, worker_id: str, stats: pb.StatsResponse) -> None:
        self.gauge.labels(*self.fixed, worker_id).set(self.value(stats))

    def remove(self, worker_id: str) -> None:
        self.gauge.remove(*self.fixed, worker_id)


class _WorkerCounters:
    """Cumulative figures of the workers' last Stats as counters (a worker's restart
    starts its series over, which ``rate`` reads as a reset): vLLM's
    ``vllm:num_preemptions_total``, per worker."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Mapping[str, pb.StatsResponse] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Requests a worker put back to recompute (its KV cache "
            "was full).", labels=["model_name", "worker"],
        )  # fmt: skip
        for worker_id, stats in self.stats.items():
            preemptions.add_metric([self.model_name, worker_id], stats.num_preemptions)
        yield preemptions


def _kv_usage(stats: pb.StatsResponse) -> float:
    return stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0


class RouterMetrics:
    def __init__(self, model_name: str, max_model_len: int = 1 << 17) -> None:
        self.registry = CollectorRegistry()
        # The live plan (router/live_plan.py) when planner.profile is set: it sizes the
        # sequences served, and shows its plan in this registry.
        self.live_plan: LivePlan | None = None
        self._observed_workers: set[str] = set()  # the workers ``worker_available`` lists
        self._gauged_workers: set[str] = set()  # ... and those the load gauges have series for
        labels = {"model_name": model_name}
        r = self.registry

        def histogram(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ["model_name"], registry=r, buckets=buckets).labels(
                **labels
            )

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency.")
        # Per sequence served (vLLM's request histograms): its parts and its sizes.
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Queueing before the "
                                    "prompt is computed (pdserve:ttft_queue_seconds).")  # fmt: skip
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Prompt "
                                      "computation (pdserve:ttft_prefill_seconds).")  # fmt: skip
        self.decode_time = histogram("vllm:request_decode_time_seconds", "From a sequence's "
                                     "first token to its last.")  # fmt: skip
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "A sequence's decode time over its tokens after the first.",
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens "
                                               "of each sequence served.", tokens)  # fmt: skip
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Tokens "
                                                   "each sequence generated.", tokens)  # fmt: skip
        gauge = lambda name, doc: Gauge(name, doc, ["model_name"], registry=r).labels(**labels)  # noqa: E731
        self.running = gauge(
            "vllm:num_requests_running", "Sequences in a decode worker's batch (its last Stats)."
        )
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences admitted here and not in "
                             "a decode batch: queued, prefilling, moving KV.")  # fmt: skip
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found cached.")
        # Counted as they happen, per sequence (vLLM V1's): a prompt at its first token,
        # generated tokens as they arrive, a sequence when it ends, however it ends.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens served.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self._requests = Counter("vllm:request_success", "Ended sequences by finished_reason "
                                 "(stop, length; abort: the client went away; error: it failed).",
                                 ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self._model_name = model_name
        self.decisions = Counter("pdserve:routing_decisions", "Placements by kind.",
                                 ["kind", "worker"], registry=r)  # fmt: skip
        self._decided: set[tuple[str, str]] = set()  # its series: (kind, worker)
        self.decision_latency = histogram(
            "pdserve:routing_decision_seconds", "Time to place a request.", _DECISION_BUCKETS
        )
        self.ttft_queue = histogram("pdserve:ttft_queue_seconds", "Queueing before the prompt "
                                    "is computed, where it is (a prefill worker, or the decode "
                                    "worker for a local prefill).")  # fmt: skip
        self.ttft_prefill = histogram("pdserve:ttft_prefill_seconds", "Prompt computation, "
                                      "where it ran.")  # fmt: skip
        self.transfer = histogram("pdserve:kv_transfer_seconds", "KV pull on the decode side.")
        self.blocks_pulled = counter("pdserve:kv_blocks_pulled", "KV blocks moved.")
        self.prefill_failures = counter("pdserve:prefill_failures", "Failed prefill hops.")
        self.prefill_fallbacks = counter(
            "pdserve:prefill_fallbacks", "Requests prefilled locally after prefill failures."
        )
        self.decode_failures = counter("pdserve:decode_failures", "Failed decode hops.")
        self.decode_migrations = counter(
            "pdserve:decode_migrations", "Streaming sequences moved to another decode worker."
        )
        worker_gauge = lambda name, doc: Gauge(name, doc, ["worker"], registry=r)  # noqa: E731
        # Per worker: a gauge and the StatsResponse value it shows.
        pairs: tuple[tuple[Gauge, Callable[[pb.StatsResponse], float]], ...] = (
            (worker_gauge("pdserve:worker_kv_blocks_used", "Device KV blocks."),
             lambda stats: stats.kv_blocks_used),
            (worker_gauge("pdserve:worker_kv_blocks_total", "Device KV blocks it has."),
             lambda stats: stats.kv_blocks_total),
            (worker_gauge("pdserve:worker_kv_blocks_quarantined",
                          "Device KV blocks a failed pull may still write (a frozen peer's "
                          "late READ), out of use until it ends."),
             lambda stats: stats.kv_blocks_quarantined),
            (worker_gauge("pdserve:worker_kv_cache_usage",
                          "Used over total device KV blocks, 0 to 1 (as "
                          "vllm:kv_cache_usage_perc)."),
             _kv_usage),
            (worker_gauge("pdserve:worker_requests_running", "Requests in its batch."),
             lambda stats: stats.num_running),
            (worker_gauge("pdserve:worker_requests_waiting",
                          "Requests queued or pulling KV there."),
             lambda stats: stats.num_waiting),
            (worker_gauge("pdserve:worker_preemptions",
                          "Requests put back to recompute (cumulative)."),
             lambda stats: stats.num_preemptions),
            (worker_gauge("pdserve:worker_cpu_blocks_used", "CPU-tier blocks."),
             lambda stats: stats.cpu_blocks_used),
            (worker_gauge("pdserve:worker_cpu_blocks_total", "CPU-tier size."),
             lambda stats: stats.cpu_blocks_total),
            (worker_gauge("pdserve:worker_offloaded_bytes",
                          "Bytes copied to the CPU tier (cumulative)."),
             lambda stats: stats.offloaded_bytes),
            (worker_gauge("pdserve:worker_cpu_hit_blocks",
                          "Blocks loaded back from the CPU tier (cumulative)."),
             lambda stats: stats.cpu_hit_blocks),
            (worker_gauge("pdserve:worker_cpu_load_seconds",
                          "Time spent loading blocks back (cumulative)."),
             lambda stats: stats.cpu_load_ms_total / 1000),
            (worker_gauge("pdserve:worker_draft_tokens",
                          "Speculative draft tokens verified (cumulative)."),
             lambda stats: stats.draft_tokens),
            (worker_gauge("pdserve:worker_accepted_draft_tokens",
                          "Speculative draft tokens kept (cumulative)."),
             lambda stats: stats.accepted_draft_tokens),
            (worker_gauge("pdserve:worker_expert_imbalance",
                          "Expert parallelism: the last rebalance window's busiest rank "
                          "over the mean rank (1.0: balanced; 0 before the first)."),
             lambda stats: stats.expert_imbalance),
            (worker_gauge("pdserve:worker_expert_moved_slots",
                          "Expert slots moved by rebalancing (cumulative)."),
             lambda stats: stats.expert_moved_slots),
            (worker_gauge("pdserve:worker_engine_steps",
                          "Engine steps that ran a forward pass (cumulative)."),
             lambda stats: stats.engine_steps),
            (worker_gauge("pdserve:worker_engine_busy_seconds",
                          "Wall time of those steps (cumulative): its rate is how busy the "
                          "worker is; over the steps' rate, its mean step."),
             lambda stats: stats.engine_busy_seconds),
            (worker_gauge("pdserve:worker_images_encoded",
                          "Images run through the vision encoder (cumulative)."),
             lambda stats: stats.images_encoded),
        )  # fmt: skip
        kv_usage = Gauge("vllm:kv_cache_usage_perc", "Used over total device KV blocks of "
                         "a worker, 0 to 1.", ["model_name", "worker"], registry=r)  # fmt: skip
        self._worker_gauges = (*(_PerWorker(gauge, value) for gauge, value in pairs),
                               _PerWorker(kv_usage, _kv_usage, (model_name,)))  # fmt: skip
        self._worker_counters = _WorkerCounters(model_name)
        r.register(self._worker_counters)
        # Separate from the stats gauges: it is the router's view (probes answered, not
        # draining), not a figure the worker reports.
        self.worker_available = worker_gauge(
            "pdserve:worker_available", "1 while the router places new work on it, else 0."
        )
        self.rejected = Counter("pdserve:requests_rejected", "Requests refused by status.",
                                ["status"], registry=r)  # fmt: skip

    def refused(self, status: int) -> None:
        """A request answered with this error status (wherever it was refused)."""
        self.rejected.labels(status=str(status)).inc()

    def observe_placement(self, placement: Placement, seconds: float) -> None:
        kind = "disaggregated" if placement.disaggregated else "local"
        worker = placement.prefill_worker or placement.decode_worker
        self.decisions.labels(kind=kind, worker=worker).inc()
        self._decided.add((kind, worker))
        self.decision_latency.observe(seconds)

    def sequence_ended(self, finished_reason: str) -> None:
        self._requests.labels(model_name=self._model_name, finished_reason=finished_reason).inc()

    def sequence_served(
        self, prompt_tokens: int, cached_tokens: int, output_tokens: int, ttft_s: float,
        decode_s: float,
    ) -> None:  # fmt: skip
        """A sequence that ended with its output: its shape, its time to first token and
        from its first token to its last (vLLM's request histograms, and the live plan)."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(output_tokens)
        self.decode_time.observe(decode_s)
        if output_tokens > 1:
            self.time_per_output_token.observe(decode_s / (output_tokens - 1))
        if self.live_plan is not None:
            self.live_plan.sequence_served(prompt_tokens, cached_tokens, output_tokens, ttft_s,
                                           decode_s)  # fmt: skip

    def prefix_cache(self, num_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(num_tokens)
        self.prefix_hits.inc(cached_tokens)

    def observe_prefill(self, timings: pb.StageTimings) -> None:
        for queue, prefill in ((self.ttft_queue, self.ttft_prefill),
                               (self.queue_time, self.prefill_time)):  # fmt: skip
            queue.observe(timings.queue_ms / 1000)
            prefill.observe(timings.prefill_ms / 1000)

    def observe_decode(
        self, timings: pb.StageTimings, blocks_pulled: int, prefilled_here: bool = False
    ) -> None:
        """A decode hop's first reply, which says its stages up to its first token;
        ``prefilled_here``: it computed the prompt itself (a local prefill), so its
        queueing and prefill are the request's (those of local prefills, every one in a
        colocated deployment, went unrecorded)."""
        if timings.transfer_ms:
            self.transfer.observe(timings.transfer_ms / 1000)
        if prefilled_here:
            self.observe_prefill(timings)
        self.blocks_pulled.inc(blocks_pulled)

    def observe_workers(
        self, stats: Mapping[str, pb.StatsResponse], available: Collection[str]
    ) -> None:
        """Per-worker gauges for the workers in ``stats`` (``available``: those the router
        places new work on); series of workers that left go (frozen values would read as
        live ones, and worker ids churn), and so do the load series of workers not
        available (their stats stop coming once they drain or stall: a drained worker
        read as 2 requests running for as long as it stayed listed)."""
        for worker_id in self._observed_workers - stats.keys():
            self.worker_available.remove(worker_id)
        for worker_id in self._gauged_workers - (stats.keys() & available):
            for gauge in self._worker_gauges:
                gauge.remove(worker_id)
        for kind, worker_id in [d for d in self._decided if d[1] not in stats]:
            self.decisions.remove(kind, worker_id)  # (they grew with every worker ever seen)
            self._decided.discard((kind, worker_id))
        self._observed_workers = set(stats)
        self._gauged_workers = stats.keys() & available
        self._worker_counters.stats = {w: stats[w] for w in self._gauged_workers}
        for worker_id, worker in stats.items():
            if worker_id in available:
                for gauge in self._worker_gauges:
                    gauge.set(worker_id, worker)
            self.worker_available.labels(worker=worker_id).set(worker_id in available)

    def render(self) -> bytes:
        return generate_latest(self.registry)
