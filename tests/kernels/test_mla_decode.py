"""The Triton MLA decode kernel against ``kernels.reference`` (absorbed latent attention).

On CPU the kernel runs in Triton's interpreter, so shapes stay small: a latent of 64 + 32
(DeepSeek's 512 + 64, scaled down), split 48 | 48 over the K and V slots."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.mla_decode import mla_decode
from tests.kernels.paged_batch import TOLERANCES, make_batch
from tests.kernels.triton_env import DEVICE

RANK, ROPE = 64, 32
SEQ_LENS = [1, 37, 64, 100, 17]  # a first token, mid-block, block-aligned, multi-tile


def _case(num_heads: int, block_size: int, dtype: torch.dtype, kv_dtype=None, rank=RANK,
          rope=ROPE, seq_lens=SEQ_LENS):  # fmt: skip
    """A paged cache of latents (unused slots NaN: a read of one poisons the output), an
    absorbed query per sequence, and the reference's output."""
    batch = make_batch([(1, n) for n in seq_lens], num_q_heads=1, num_kv_heads=1,
                       head_dim=(rank + rope) // 2, block_size=block_size, dtype=dtype,
                       device=DEVICE, kv_dtype=kv_dtype)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(len(seq_lens), num_heads, rank + rope, generator=gen).to(dtype)
    query = query.to(DEVICE)
    scale = (rank + rope) ** -0.5
    expected = reference.paged_attention(
        query.float(), batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        scale, latent_dim=rank,
    )  # fmt: skip
    return batch, query, scale, expected


@pytest.mark.parametrize("num_heads", [4, 20])  # under one block of 16 heads; over it
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_reference(num_heads, block_size, dtype):
    batch, query, scale, expected = _case(num_heads, block_size, dtype)
    out = mla_decode(query, batch.kv_cache, batch.seq_lens, batch.block_table, scale, RANK,
                     num_splits=1)  # fmt: skip
    assert out.shape == (len(SEQ_LENS), num_heads, RANK) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("num_splits", [2, 4, None])  # None: the launcher's choice
def test_split_kv_merges_to_the_same_output(num_splits):
    """Splits that get no tile (the 1- and 17-token sequences) weigh nothing in the merge."""
    batch, query, scale, expected = _case(4, 16, torch.float32)
    out = mla_decode(query, batch.kv_cache, batch.seq_lens, batch.block_table, scale, RANK,
                     max_seq_len=max(SEQ_LENS), num_splits=num_splits)  # fmt: skip
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_an_fp8_cache_reads_as_the_reference_reads_it():
    batch, query, scale, expected = _case(4, 16, torch.float16, kv_dtype=torch.float8_e4m3fn)
    out = mla_decode(query, batch.kv_cache, batch.seq_lens, batch.block_table, scale, RANK)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[torch.float16])


def test_deepseek_v3_widths():
    """V3's own latent (512 + 64, halves of 288: slot boundaries inside c_kv), few tokens."""
    batch, query, scale, expected = _case(16, 64, torch.float32, rank=512, rope=64,
                                          seq_lens=[3, 70])  # fmt: skip
    out = mla_decode(query, batch.kv_cache, batch.seq_lens, batch.block_table, scale, 512)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_shapes_it_cannot_serve_are_refused():
    batch, query, scale, _ = _case(4, 16, torch.float32)
    with pytest.raises(ValueError, match="powers of two"):
        mla_decode(query, batch.kv_cache, batch.seq_lens, batch.block_table, scale, 48)
    with pytest.raises(ValueError, match="does not hold latents"):
        mla_decode(query[..., :-2], batch.kv_cache, batch.seq_lens, batch.block_table, scale,
                   RANK)  # fmt: skip
