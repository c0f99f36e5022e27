"""KV store in Triton: the fast twin of ``reference.store_kv``.

One program per token copies that token's K and V (all KV heads) into its slot, converting to
the cache's dtype; a negative slot is skipped (padding tokens).

An FP8 cache gets what ``reference.to_cache_dtype`` gives: values clamped to the format's
largest finite value, then rounded to nearest even. The kernel clamps too (``FP8_MAX``)
and Triton rounds the same way on a GPU; its CPU interpreter does not (it flushes small
values to zero and maps 500 to 256 in e4m3), so there K/V are converted by torch first
and the kernel copies bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPES, to_cache_dtype
from kernels.triton_utils import is_interpreted, next_pow2, require_runnable


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,
    stride_kv,
    stride_tok,
    stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # an FP8 cache's largest finite value (saturate there); 0: not FP8
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)
    dst = (
        kv_cache_ptr
        + (slot // BLOCK_SIZE) * stride_block
        + (slot % BLOCK_SIZE) * stride_tok
        + offs_h * stride_head
        + offs_d
    )
    key = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    if FP8_MAX > 0:
        key = tl.clamp(key.to(tl.float32), -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32), -FP8_MAX, FP8_MAX)
    tl.store(dst, key.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def kernels_interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when they were
    imported: CPU tensors allowed), not compiled CUDA code. One kernel decides for all:
    Triton reads the variable once per import."""
    return is_interpreted(_store_kv_kernel)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot means "skip"
) -> None:
    """Write each token's K and V into its slot. Slots must be distinct and in range (not
    checked: the check would cost a device sync); key/value may be strided views."""
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit kv_cache "
            f"{tuple(kv_cache.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"{slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    if key.shape[0] == 0:
        return
    require_runnable(_store_kv_kernel, key, value, kv_cache, slot_mapping)
    fp8_max = 0.0
    if kv_cache.dtype in FP8_DTYPES:
        if is_interpreted(_store_kv_kernel):
            key = to_cache_dtype(key, kv_cache.dtype)
            value = to_cache_dtype(value, kv_cache.dtype)
        else:
            fp8_max = torch.finfo(kv_cache.dtype).max
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    slot_mapping = slot_mapping.contiguous()  # read with element stride 1
    num_heads, head_dim = key.shape[1], key.shape[2]
    _store_kv_kernel[(key.shape[0],)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(num_heads),
        HEAD_DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        FP8_MAX=fp8_max,
        num_warps=4,
    )
