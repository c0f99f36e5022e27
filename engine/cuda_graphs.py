"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket.

A decode step of a small model is mostly kernel-launch and Python overhead; replaying a
captured graph removes both. Only steps where every sequence computes exactly one token are
replayed (prefill chunks vary too much in shape); the batch is padded to the next bucket
with rows that write nothing (slot -1) and attend to nothing (sequence length 0).

Static buffers (sized for the largest bucket) hold the step's inputs; a step copies its
values in, replays, and reads the hidden states of its real rows. Only the model's forward
is captured; logits and sampling run eagerly on those rows. Needs an attention backend
that never reads device values on the host (the Triton backend, given ``max_seq_len``).

MoE layers that count the pairs routed to their experts (expert rebalancing) count a
row by ``real_rows`` in the graph: padding rows, all alike, all routed to the same
experts, counted as real ones made those look hot (an audit: 63 rows a step at a batch
of 129 in the 192 bucket).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch

from engine.attention.backend import AttentionBackend, BatchLayout
from engine.models.moe import SparseMoe

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        counting: Sequence[SparseMoe] = (),
    ) -> None:
        """``counting``: the MoE layers that count the pairs routed to their experts."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [max_batch]
        size = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        new = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = new(size, dtype=torch.int64)
        self.positions = new(size, dtype=torch.int64)
        self.slot_mapping = new(size, dtype=torch.int64)
        self.seq_lens = new(size, dtype=torch.int32)
        self.block_table = new(size, self.max_blocks, dtype=torch.int32)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.real_rows = new(size, dtype=torch.int64)  # 1 for a step's rows, 0 for padding
        self._counting = list(counting)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _layout(self, batch: int) -> BatchLayout:
        return BatchLayout(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_table=self.block_table[:batch],
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[self.max_model_len] * batch,  # host values are never read
            num_decodes=batch,
            max_query_len=1,
            max_seq_len=self.max_model_len,  # fixed: the split count must not change
        )

    def _forward(self, batch: int) -> torch.Tensor:
        metadata = self.backend.build_metadata(self._layout(batch))
        with self._rows_counted():
            return self.model(
                self.input_ids[:batch], self.positions[:batch], self.kv_caches, metadata
            )

    @contextlib.contextmanager
    def _rows_counted(self) -> Iterator[None]:
        """The counting MoE layers read ``real_rows`` while the graph is recorded (a
        replay reads it again); eager steps count every row."""
        for moe in self._counting:
            moe.counted_rows = self.real_rows
        try:
            yield
        finally:
            for moe in self._counting:
                moe.counted_rows = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory pool)."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = None
        stream = torch.cuda.Stream()
        for batch in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.buckets[-1]

    @torch.inference_mode()
    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,  # [batch, width] int32 on the host (HostBatch's)
    ) -> torch.Tensor:  # [batch, hidden_size]
        batch = len(input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        pad = bucket - batch
        width = block_table.shape[1]
        device = self.input_ids.device
        self.input_ids[:bucket].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.tensor(slot_mapping + [-1] * pad), non_blocking=True)
        self.seq_lens[:bucket].copy_(
            torch.tensor(seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True
        )
        self.block_table[:batch, :width].copy_(block_table.to(device, non_blocking=True))
        self.block_table[batch:bucket, :width].zero_()  # the padding sequences'
        if self._counting:
            self.real_rows[:batch].fill_(1)
            self.real_rows[batch:bucket].zero_()
        graph, hidden = self.graphs[bucket]
        graph.replay()
        self.num_replays += 1
        return hidden[:batch]
