"""Device code of paged attention: one kernel for decode and prefill segments, plus the merge
of split-KV partial results. The launcher (``paged_attention.py``) states the contract.

A program owns one *q block* of one segment and one KV head: ``BLOCK_M`` rows, each a
(query token, query head of that KV head's group) pair, so every K/V tile it loads serves the
whole GQA group:

    row m  ->  token  q_block * BLOCK_Q + m // NUM_QUERIES_PER_KV
               head   kv_head * NUM_QUERIES_PER_KV + m % NUM_QUERIES_PER_KV

It walks the keys ``TILE_N`` at a time (tiles are aligned to multiples of ``TILE_N`` from
position 0 and may straddle cache blocks: each key finds its block through the block table)
with an online softmax in base 2. Tiles every row sees entirely skip the causal / window
masks; only the edge tiles pay for them. With ``NUM_SPLITS > 1`` (flash-decoding; decode
launches only, where segment i is query row i) the tiles of a segment are cut into that many
contiguous ranges, one program each; each writes its normalised partial output and
log2-sum-exp, and ``merge_splits_kernel`` combines them. Attention sinks (GPT-OSS) enter as
the online softmax's starting state: max = the head's sink, sum = 1, output 0 (split 0 only).

Each row sees the keys below its *key end*: its position + 1 (causal), or with
``USE_KEY_ENDS`` (prefill launches) the value the caller gives, at least that (an image token
sees its whole image). So the tiles every row sees whole stay those below the first row's
position + 1, and a q block reads keys up to the largest key end of its rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_segment(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The segment owning ``q_block_id``. Segment i's q blocks start at
    ``(start_i - start_0) // BLOCK_Q + i``: disjoint ranges, at most one idle id each."""
    base = tl.load(query_start_loc_ptr)
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid
        if first <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_rows(ptrs, row_ok, d_ok, ROW_MASK: tl.constexpr, DIM_MASK: tl.constexpr):
    """Load a [rows, HEAD_DIM_PAD] tile, masking only what may be out of bounds."""
    if ROW_MASK:
        if DIM_MASK:
            return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    if DIM_MASK:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32, un-normalised output
    l_i,  # [BLOCK_M] fp32, running sum of exp2
    m_i,  # [BLOCK_M] fp32, running max (log2 domain)
    q,  # [BLOCK_M, HEAD_DIM_PAD] DOT_DTYPE
    q_pos,  # [BLOCK_M] int32, position of each row's token
    key_end,  # [BLOCK_M] int32, each row sees keys below this (causal: q_pos + 1)
    k_base,  # pointer: this KV head's K in block 0, slot 0
    block_row_ptr,  # pointer: this segment's block-table row
    tile_begin,
    tile_end,
    kv_end,  # keys at or past this position are never loaded
    window,
    qk_scale,  # softmax scale * log2(e)
    stride_block,
    stride_kv,
    stride_tok,
    offs_d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DIM_MASK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_t = tl.arange(0, TILE_N)
    for tile in range(tile_begin, tile_end):
        offs_n = tile * TILE_N + offs_t
        in_bounds = offs_n < kv_end
        if MASKED:
            block = tl.load(block_row_ptr + offs_n // BLOCK_SIZE, mask=in_bounds, other=0)
        else:
            block = tl.load(block_row_ptr + offs_n // BLOCK_SIZE)
        slot = block.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_tok
        k_ptrs = k_base + slot[:, None] + offs_d[None, :]
        k = _load_rows(k_ptrs, in_bounds, d_ok, MASKED, DIM_MASK).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # unscaled
        if MASKED:
            visible = offs_n[None, :] < key_end[:, None]
            if USE_WINDOW:
                visible &= offs_n[None, :] > q_pos[:, None] - window
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MASKED:  # a row may have seen no key yet: keep exp2 away from inf - inf
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        p = tl.math.exp2(s * qk_scale - m_ref[:, None])  # one FMA per score
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(k_ptrs + stride_kv, in_bounds, d_ok, MASKED, DIM_MASK).to(DOT_DTYPE)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["window", "num_seqs", "first_seq"])  # no recompiles per step
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    kv_cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    block_table_ptr,  # [num_seqs, max_blocks]
    part_out_ptr,  # [num_decodes, num_q_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32 (splits only)
    part_lse_ptr,  # [num_decodes, num_q_heads, NUM_SPLITS] fp32 (splits only)
    sinks_ptr,  # [num_q_heads] (USE_SINKS only)
    key_ends_ptr,  # [num_tokens] int32 (USE_KEY_ENDS only)
    qk_scale,
    window,
    first_seq,  # this launch serves segments first_seq .. first_seq + num_seqs - 1
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_kv,
    stride_tok,
    stride_head,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_KEY_ENDS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    NUM_KV_HEADS: tl.constexpr = NUM_Q_HEADS // NUM_QUERIES_PER_KV
    split = tl.program_id(2)
    query_start_loc_ptr += first_seq
    seq_lens_ptr += first_seq
    block_table_ptr += first_seq.to(tl.int64) * stride_bt
    if DECODE_ONLY:  # one program per segment; segment i is query row i
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        q_start = seq
        query_len = 1
        q_block = 0
    else:
        # One flat grid, KV heads fastest: the GPU starts programs in id order, so every
        # head's last q blocks (the most keys) start first and the short ones fill the tail.
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        q_block_id = tl.num_programs(0) // NUM_KV_HEADS - 1 - tl.program_id(0) // NUM_KV_HEADS
        base = tl.load(query_start_loc_ptr)
        seq = _find_segment(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_block = q_block_id - ((q_start - base) // BLOCK_Q + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= query_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - query_len  # position of the segment's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    DIM_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    row_tok = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    row_head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m // NUM_QUERIES_PER_KV < BLOCK_Q) & (row_tok < query_len)
    q_pos = ctx_start + row_tok
    if USE_KEY_ENDS:  # capped at the context: a key past it is never visible
        key_end = tl.load(key_ends_ptr + q_start + row_tok, mask=row_ok, other=0)
        key_end = tl.minimum(key_end, seq_len)
    else:
        key_end = q_pos + 1
    q_ptrs = query_ptr + ((q_start + row_tok).to(tl.int64) * stride_qt + row_head * stride_qh)
    q = _load_rows(q_ptrs[:, None] + offs_d[None, :], row_ok, d_ok, True, DIM_MASK)
    q = q.to(DOT_DTYPE)

    # Keys this q block needs, and the tiles that every one of its rows sees whole.
    first_pos = ctx_start + q_block * BLOCK_Q
    causal_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # last row's position + 1
    if USE_KEY_ENDS:  # masked rows' key ends are 0
        kv_end = tl.maximum(causal_end, tl.max(key_end, 0))
    else:
        kv_end = causal_end
    full_end = tl.maximum(first_pos + 1, 0) // TILE_N
    if USE_WINDOW:
        tile_begin = tl.maximum(first_pos - window + 1, 0) // TILE_N
        full_begin = tl.cdiv(tl.maximum(causal_end - window, 0), TILE_N)
        full_end = tl.maximum(full_end, full_begin)
    else:
        tile_begin = 0
        full_begin = 0
    tile_end = tl.cdiv(tl.maximum(kv_end, 0), TILE_N)
    tiles_per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
    lo = tile_begin + split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, tile_end)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if USE_SINKS:  # the head's sink starts the softmax as a key of weight 2^0 without value
        sink = tl.load(sinks_ptr + row_head).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_i = tl.where(split == 0, sink, m_i)  # in one split only: the merge adds them up
        l_i = tl.where(split == 0, 1.0, l_i)
    k_base = kv_cache_ptr + kv_head * stride_head
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    if USE_WINDOW:  # tiles cut by the window's lower edge
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, key_end, k_base, block_row_ptr, lo, tl.minimum(hi, full_begin),
            kv_end, window, qk_scale, stride_block, stride_kv, stride_tok, offs_d, d_ok,
            BLOCK_SIZE, TILE_N, True, USE_WINDOW, DIM_MASK, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, key_end, k_base, block_row_ptr, tl.maximum(lo, full_begin),
        tl.minimum(hi, full_end), kv_end, window, qk_scale, stride_block, stride_kv,
        stride_tok, offs_d, d_ok,
        BLOCK_SIZE, TILE_N, False, USE_WINDOW, DIM_MASK, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(  # tiles cut by the causal diagonal or the context's end
        acc, l_i, m_i, q, q_pos, key_end, k_base, block_row_ptr, tl.maximum(lo, full_end), hi,
        kv_end, window, qk_scale, stride_block, stride_kv, stride_tok, offs_d, d_ok,
        BLOCK_SIZE, TILE_N, True, USE_WINDOW, DIM_MASK, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no key at all: zeros
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + ((q_start + row_tok).to(tl.int64) * stride_ot + row_head * stride_oh)
        o_mask = row_ok[:, None] & d_ok[None, :]
        tl.store(o_ptrs[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), o_mask)
    else:
        # Splits run in the decode launch only: the partial row is the query row.
        part_row = (q_start + row_tok).to(tl.int64) * NUM_Q_HEADS + row_head
        part_row = part_row * NUM_SPLITS + split
        lse = m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i))
        lse = tl.where(l_i == 0.0, float("-inf"), lse)
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        p_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(p_ptrs, out, mask=row_ok[:, None])


@triton.jit
def merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    part_out_ptr,  # [num_rows, num_q_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
    part_lse_ptr,  # [num_rows, num_q_heads, NUM_SPLITS] fp32
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """out = sum_s 2^lse_s * o_s / sum_s 2^lse_s; empty splits (lse = -inf) weigh nothing."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (row.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part)
    lse_max = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
