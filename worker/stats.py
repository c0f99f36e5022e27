"""Per-stage timing averages and the Stats reply both roles serve."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.async_engine import EngineStats
from engine.models.lora import LoraAdapter
from proto import pdserve_pb2 as pb


@dataclass(slots=True)
class StageTimer:
    """Running sums of per-request stage times (ms); read for means in Stats."""

    count: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0

    def add(self, timings: pb.StageTimings) -> None:
        self.count += 1
        self.queue_ms += timings.queue_ms
        self.prefill_ms += timings.prefill_ms
        self.transfer_ms += timings.transfer_ms
        self.decode_ms += timings.decode_ms

    def means(self) -> pb.StageTimings:
        n = max(self.count, 1)
        return pb.StageTimings(
            queue_ms=self.queue_ms / n,
            prefill_ms=self.prefill_ms / n,
            transfer_ms=self.transfer_ms / n,
            decode_ms=self.decode_ms / n,
        )


def stats_reply(
    engine_id: str,
    role: str,
    stats: EngineStats,
    timer: StageTimer,
    draining: bool,
    lora_adapters: Iterable[LoraAdapter] = (),
    **extra: int,
) -> pb.StatsResponse:
    return pb.StatsResponse(
        engine_id=engine_id,
        role=role,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting + stats.num_fetching,
        kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_free=stats.kv_blocks_free,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_quarantined=stats.kv_blocks_quarantined,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        prefix_query_tokens=stats.prefix_query_tokens,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        blocks_reused_locally=stats.num_blocks_reused_for_remote,
        transfer_failures=stats.num_pull_failures,
        requests_finished=timer.count,
        num_preemptions=stats.num_preemptions,
        mean_timings=timer.means(),
        draining=draining,
        cpu_blocks_total=stats.cpu_blocks_total,
        cpu_blocks_used=stats.cpu_blocks_used,
        offloaded_blocks=stats.offloaded_blocks,
        offloaded_bytes=stats.offloaded_bytes,
        cpu_hit_blocks=stats.cpu_hit_blocks,
        cpu_load_ms_total=stats.cpu_load_seconds * 1000,
        draft_tokens=stats.draft_tokens,
        accepted_draft_tokens=stats.accepted_draft_tokens,
        expert_rebalances=stats.expert_rebalances,
        expert_moved_slots=stats.expert_moved_slots,
        expert_imbalance=stats.expert_imbalance,
        images_encoded=stats.images_encoded,
        engine_steps=stats.num_steps,
        engine_busy_seconds=stats.busy_s,
        lora_adapters=[
            pb.LoraAdapterInfo(name=adapter.name, fingerprint=adapter.fingerprint)
            for adapter in lora_adapters
        ],
        **extra,
    )
