"""A decode step's block table on the host: the persistent table against lists rebuilt
every step, side by side in one process.

    python -m benchmarks.host_batch [--batch 64 256] [--context 2048 8192 32768]

Each case runs ``--steps`` decode steps of ``batch`` sequences of ``context`` tokens
(block size 16), every sequence growing by a token a step (a new block every 16 steps),
and times what the host does to hand attention its block table:

- *lists* (the engine up to 093256a): the block ids read out of the manager's block
  objects (``[block.block_id for block in blocks]``), each row cut to its sequence's
  blocks, padded, and turned into a tensor with ``torch.tensor``;
- *persistent* (now): the manager's id list as it is (``block_ids_view``) and
  ``engine.block_table.BlockTable.gather``, which writes only the ids added since the
  last step and gathers the batch's rows with one ``index_select``.

Both tables are checked equal on every sequence's own blocks. The device copy that
follows is the same for both and is not timed. Records JSON and Markdown under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks import revisions
from common.intmath import cdiv
from engine.block_pool import KVBlock
from engine.block_table import BlockTable

BLOCK_SIZE = 16


def table_from_lists(blocks: list[list[KVBlock]], seq_lens: list[int]) -> torch.Tensor:
    """What the engine did every step up to 093256a (``KVCacheManager.get_block_ids``,
    ``ModelRunner._host_batch``'s rows, ``ModelShard._layout``'s padded table)."""
    rows = []
    for held, end in zip(blocks, seq_lens, strict=True):
        ids = [block.block_id for block in held]
        rows.append(ids[: cdiv(end, BLOCK_SIZE)])
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32)


def run_case(batch: int, context: int, steps: int) -> dict:
    num_blocks = cdiv(context + steps, BLOCK_SIZE)
    # Distinct, scattered block ids per sequence (as a real pool hands them out).
    order = torch.randperm(batch * num_blocks, generator=torch.Generator().manual_seed(0))
    all_ids = order.view(batch, num_blocks).tolist()
    held_blocks = [[KVBlock(i) for i in ids[: cdiv(context, BLOCK_SIZE)]] for ids in all_ids]
    held_ids = [ids[: cdiv(context, BLOCK_SIZE)] for ids in all_ids]
    request_ids = [f"r{i}" for i in range(batch)]
    table = BlockTable(batch + 32, num_blocks + 1)
    lists_s: list[float] = []
    persistent_s: list[float] = []
    for step in range(steps + 1):  # step 0 fills the persistent rows (a prefill's step)
        seq_len = context + step
        for i in range(batch):  # the manager appends a block when a token needs one
            while len(held_ids[i]) < cdiv(seq_len, BLOCK_SIZE):
                block_id = all_ids[i][len(held_ids[i])]
                held_ids[i].append(block_id)
                held_blocks[i].append(KVBlock(block_id))
        seq_lens = [seq_len] * batch
        start = time.perf_counter()
        old = table_from_lists(held_blocks, seq_lens)
        lists_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        new = table.gather(request_ids, held_ids, cdiv(seq_len, BLOCK_SIZE))
        persistent_s.append(time.perf_counter() - start)
        if not torch.equal(old, new):
            raise AssertionError(f"tables differ at batch {batch}, context {context}, step {step}")
    lists_ms = statistics.median(lists_s[1:]) * 1e3
    persistent_ms = statistics.median(persistent_s[1:]) * 1e3
    return {
        "batch": batch, "context": context, "block_size": BLOCK_SIZE, "steps": steps,
        "lists_ms": lists_ms, "persistent_ms": persistent_ms,
        "speedup": lists_ms / persistent_ms, "first_step_persistent_ms": persistent_s[0] * 1e3,
    }  # fmt: skip


def markdown(record: dict) -> str:
    lines = [
        "# A decode step's block table on the host: persistent rows against lists",
        "",
        f"{revisions.command_line(record, 'host_batch')}. Median over {record['steps']} "
        "decode steps after the step that fills the rows; block size 16; equal tables "
        "checked every step.",
        "",
        "| batch | context (tokens) | lists ms/step | persistent ms/step | lists / persistent "
        "| persistent, first step ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['lists_ms']:.3f} "
            f"| {row['persistent_ms']:.3f} | {row['speedup']:.1f}x "
            f"| {row['first_step_persistent_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=32)
    revisions.add_record_args(parser)
    args = parser.parse_args(argv)
    rows = []
    for batch in args.batch:
        for context in args.context:
            row = run_case(batch, context, args.steps)
            rows.append(row)
            print(f"batch {batch:4d} context {context:6d}: lists {row['lists_ms']:8.3f} ms  "
                  f"persistent {row['persistent_ms']:7.3f} ms  {row['speedup']:6.1f}x",
                  flush=True)  # fmt: skip
    revisions.write_record(args, "host_batch", argv, {"steps": args.steps, "rows": rows},
                           markdown)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
