"""Random flattened batches over a paged KV cache, for the attention kernel tests.

Blocks are handed out in a random order, and every slot no segment owns (the tails of partly
filled blocks, unused blocks, block-table padding) holds NaN: a kernel that reads one key too
many poisons its output instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference

# Per-dtype tolerances against the fp32 reference computed from the same (rounded) inputs:
# fp16/bf16 round P before the PV product and round the output.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


@dataclass(frozen=True, slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    num_decodes: int
    scale: float

    def expected(
        self,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        key_ends: torch.Tensor | None = None,  # [num_tokens]: see reference.paged_attention
    ) -> torch.Tensor:
        """The reference in fp32 on the same inputs."""
        return reference.paged_attention(
            self.query.float(),
            self.kv_cache.float(),
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.scale,
            sliding_window,
            None if sinks is None else sinks.float(),
            key_ends=key_ends,
        )

    def positions(self) -> torch.Tensor:  # [num_tokens] int64
        """Each query row's position in its sequence (rows outside every segment: -1)."""
        pos = torch.full((self.query.shape[0],), -1, dtype=torch.long)
        starts = self.query_start_loc.tolist()
        for i, seq_len in enumerate(self.seq_lens.tolist()):
            query_len = starts[i + 1] - starts[i]
            pos[starts[i] : starts[i + 1]] = torch.arange(seq_len - query_len, seq_len)
        return pos.to(self.query.device)


def make_batch(
    segments: list[tuple[int, int]],  # (query_len, seq_len), decodes (query_len 1) first
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
    kv_dtype: torch.dtype | None = None,  # the cache's, if not ``dtype`` (FP8)
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in segments]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks  # block 0 is the padding block
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=kv_dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(segments), max([1, *blocks_per_seq]), dtype=torch.int32)
    for i, (_, seq_len) in enumerate(segments):
        ids = [order.pop() for _ in range(blocks_per_seq[i])]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(seq_len)
        kv = torch.randn(seq_len, 2, num_kv_heads, head_dim, generator=gen)
        kv_cache[torch.tensor(ids, dtype=torch.long)[pos // block_size], :, pos % block_size] = (
            kv.to(kv_dtype)
        )
    query_lens = [query_len for query_len, _ in segments]
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    num_decodes = 0
    while num_decodes < len(segments) and segments[num_decodes][0] == 1:
        num_decodes += 1
    return PagedBatch(
        query=query.to(device),
        kv_cache=kv_cache.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor([s for _, s in segments], dtype=torch.int32, device=device),
        block_table=table.to(device),
        num_decodes=num_decodes,
        scale=head_dim**-0.5,
    )


def poisoned_out(batch: PagedBatch) -> torch.Tensor:
    """An output buffer full of NaN: rows the kernel fails to write stay NaN."""
    return torch.full_like(batch.query, float("nan"))
