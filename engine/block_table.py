"""Each running request's block ids in one host tensor kept from step to step.

A step's attention needs a ``[num_seqs, max_blocks]`` block table. Built from Python lists
every step it cost O(batch x context / block_size) in Python objects: at batch 256 and 32k
tokens of context (2,048 blocks a sequence) about 26 ms of ``torch.tensor`` and 5 ms of
``[block.block_id ...]`` per step, on the host, before the GPU could start. Here each
request owns a row of a persistent int32 tensor; a step writes only the block ids added
since the request's last step (usually none, or one) and gathers its rows with one
``index_select``. vLLM keeps its block table the same way.

A row follows the KV cache manager's id list (``KVCacheManager.block_ids_view``), which is
append-only while the request holds its blocks and a new list object once it frees them
(a finish, an abort, a preemption). So the row is valid while its list object is the
request's: the list is compared by identity, and a new one starts the row again. Rows are
released when a request is forgotten, and the least recently used row not in the current
step is taken back if the table fills up (a request preempted and waiting, say).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Row:
    index: int
    block_ids: list[int]  # the manager's list this row mirrors (kept by reference)
    num_written: int


class BlockTable:
    """Host rows of block ids, ``num_rows`` requests of at most ``max_blocks`` blocks each.
    Engine thread only."""

    def __init__(self, num_rows: int, max_blocks: int, pin_memory: bool = False) -> None:
        self.max_blocks = max_blocks
        self.table = torch.zeros(num_rows, max_blocks, dtype=torch.int32, pin_memory=pin_memory)
        self._array = self.table.numpy()  # the same memory; writes without torch's overhead
        self._rows: OrderedDict[str, _Row] = OrderedDict()  # least recently used first
        self._free = list(range(num_rows - 1, -1, -1))

    def gather(
        self, request_ids: Sequence[str], block_ids: Sequence[list[int]], width: int
    ) -> torch.Tensor:
        """The first ``width`` block ids of each request, one row per request in order:
        ``[len(request_ids), width]`` int32 on the host (a new tensor). ``block_ids[i]`` is
        request i's list from ``KVCacheManager.block_ids_view``; entries past a request's
        own blocks are unspecified (attention reads only ``seq_len``'s blocks)."""
        in_step: set[str] = set(request_ids)
        indices = []
        for request_id, ids in zip(request_ids, block_ids, strict=True):
            row = self._row(request_id, ids, in_step)
            if row.num_written < len(ids):
                if len(ids) > self.max_blocks:
                    raise ValueError(
                        f"request {request_id} holds {len(ids)} blocks; the block table "
                        f"has room for {self.max_blocks}"
                    )
                self._array[row.index, row.num_written : len(ids)] = ids[row.num_written :]
                row.num_written = len(ids)
            indices.append(row.index)
        index = torch.tensor(indices, dtype=torch.long)
        return self.table[:, :width].index_select(0, index)

    def release(self, request_id: str) -> None:
        """Forget a request's row (it finished or was aborted); a no-op if it has none."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._clear(row)
            self._free.append(row.index)

    @property
    def num_rows_used(self) -> int:
        return len(self._rows)

    def _row(self, request_id: str, ids: list[int], in_step: set[str]) -> _Row:
        row = self._rows.get(request_id)
        if row is not None and row.block_ids is ids:
            self._rows.move_to_end(request_id)
            return row
        if row is not None:  # the request freed its blocks since: start the row again
            self._clear(row)
            row.block_ids = ids
            self._rows.move_to_end(request_id)
            return row
        if not self._free:
            self._evict(in_step)
        row = _Row(self._free.pop(), ids, 0)
        self._rows[request_id] = row
        return row

    def _evict(self, in_step: set[str]) -> None:
        for request_id in self._rows:
            if request_id not in in_step:
                row = self._rows.pop(request_id)
                self._clear(row)
                self._free.append(row.index)
                return
        raise RuntimeError(f"block table full: {len(self._rows)} rows, all in this step")

    def _clear(self, row: _Row) -> None:
        self._array[row.index, : row.num_written] = 0
        row.num_written = 0
