"""Decode attention for DeepSeek's latent attention (MLA) in Triton, absorbed form: the fast
twin of ``reference.decode_attention(..., latent_dim=kv_lora_rank)``.

    query     [num_seqs, num_heads, kv_lora_rank + rope_dim]   absorbed: [q_nope W_uk, q_pe]
    kv_cache  [num_blocks, 2, block_size, 1, (kv_lora_rank + rope_dim) / 2]
    out       [num_seqs, num_heads, kv_lora_rank]              softmax(q . latent) @ c_kv

A token's latent ``[c_kv, k_pe]`` is split at its middle over the K and V slots of one KV
head (``hf_config.kv_cache_heads``): latent element ``e`` sits in slot ``e // half`` at
column ``e % half``. Every head reads the same latents, so a program owns one sequence and
``BLOCK_H`` heads: each latent tile it loads (``TILE_N`` tokens, ``c_kv`` and ``k_pe``
apart, both power-of-two wide) serves all of them, in two dots for the scores and one for
the output, with an online softmax in base 2. With ``NUM_SPLITS > 1`` (small batches, long
contexts) a sequence's tiles are cut into that many ranges, one program each, merged by
``paged_attention_kernel.merge_splits_kernel``.

Verified here under Triton's interpreter against the reference; its speed on a GPU is
``benchmarks/GPU_RUNBOOK.md``'s step 9 (FlashMLA is the bar).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.intmath import cdiv
from kernels.attention_config import device_num_sms, num_kv_splits
from kernels.paged_attention_kernel import merge_splits_kernel
from kernels.triton_utils import dot_dtype, dot_precision, require_runnable

LOG2_E = 1.4426950408889634
BLOCK_H = 16  # heads per program (tl.dot's smallest M)
TILE_N = 32  # tokens per latent tile


@triton.jit
def mla_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, RANK + ROPE]
    cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, 1, HALF]
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, RANK] (NUM_SPLITS == 1)
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, RANK] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    stride_qs,
    stride_qh,
    stride_block,
    stride_kv,
    stride_tok,
    stride_bt,
    stride_os,
    stride_oh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < num_heads
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    q_rows = q_ptr + seq.to(tl.int64) * stride_qs + offs_h[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_r[None, :], mask=h_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_pe = tl.load(q_rows + RANK + offs_p[None, :], mask=h_ok[:, None], other=0.0).to(DOT_DTYPE)
    # Where latent element e of a token lies from the token's slot-0 address.
    c_cols = (offs_r // HALF) * stride_kv + offs_r % HALF
    pe_cols = ((RANK + offs_p) // HALF) * stride_kv + (RANK + offs_p) % HALF
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * per_split
    tile_end = tl.minimum(num_tiles, tile_begin + per_split)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for tile in range(tile_begin, tile_end):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        n_ok = offs_n < seq_len
        block_ids = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + offs_n // BLOCK_SIZE,
                            mask=n_ok, other=0)  # fmt: skip
        token = block_ids.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_tok
        c = tl.load(cache_ptr + token[:, None] + c_cols[None, :], mask=n_ok[:, None], other=0.0)
        pe = tl.load(cache_ptr + token[:, None] + pe_cols[None, :], mask=n_ok[:, None], other=0.0)
        c = c.to(DOT_DTYPE)  # [TILE_N, RANK]
        scores = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        scores += tl.dot(q_pe, tl.trans(pe.to(DOT_DTYPE)), input_precision=PRECISION)
        scores = tl.where(n_ok[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, TILE_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # no key in this split (or an empty sequence)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + offs_h[:, None] * stride_oh
        tl.store(o_ptrs + offs_r[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        part = (seq.to(tl.int64) * num_heads + offs_h) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * RANK + offs_r[None, :], out, mask=h_ok[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


def mla_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, kv_lora_rank + rope_dim], absorbed
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, 1, (kv_lora_rank + rope_dim) / 2]
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    kv_lora_rank: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank]
    """Each sequence's single query (all heads) over its paged latents. ``max_seq_len`` (an
    upper bound of ``seq_lens``) sizes the splits; None reads it from the device (a sync).
    ``num_splits`` (a power of two) overrides the choice. Empty sequences give zeros."""
    require_runnable(mla_decode_kernel, query, kv_cache, seq_lens, block_table)
    num_seqs, num_heads, width = query.shape
    half = kv_cache.shape[-1]
    rope = width - kv_lora_rank
    if kv_cache.dim() != 5 or kv_cache.shape[1:4:2] != (2, 1) or 2 * half != width:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not hold latents of {width}")
    if kv_lora_rank & (kv_lora_rank - 1) or rope & (rope - 1) or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} and rope dim {rope} must be powers of "
                         "two, the cache contiguous in its last dim")  # fmt: skip
    out = query.new_empty(num_seqs, num_heads, kv_lora_rank)
    if num_seqs == 0:
        return out
    head_blocks = cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = num_kv_splits(num_seqs, head_blocks, longest, TILE_N,
                                   device_num_sms(query.device))  # fmt: skip
    part_out = part_lse = out  # unused with one split
    if num_splits > 1:
        part_out = query.new_empty(num_seqs, num_heads, num_splits, kv_lora_rank,
                                   dtype=torch.float32)  # fmt: skip
        part_lse = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        query, kv_cache, block_table, seq_lens, out, part_out, part_lse,
        scale * LOG2_E, num_heads,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        RANK=kv_lora_rank, ROPE=rope, HALF=half, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=BLOCK_H, TILE_N=TILE_N, NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype(mla_decode_kernel, query.dtype),
        PRECISION=dot_precision(query.dtype),
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_heads, HEAD_DIM=kv_lora_rank, HEAD_DIM_PAD=kv_lora_rank,
            NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
