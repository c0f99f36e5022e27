"""Block gather/scatter in Triton: the fast twins of ``reference.gather_blocks`` and
``reference.scatter_blocks``, for the connectors and the offload tier.

A block is ``kv_cache[block_id]``: K and V of ``block_size`` tokens, contiguous. One launch
moves any number of blocks; each program copies one ``CHUNK`` of one block, so a list of
scattered block ids costs the same as a contiguous range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.intmath import cdiv
from kernels.triton_utils import require_runnable

CHUNK = 4096  # elements per program


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,  # [n]
    stride_src,
    stride_dst,
    block_numel,
    GATHER: tl.constexpr,  # True: cache -> staging; False: staging -> cache
    CHUNK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    block_id = tl.load(block_ids_ptr + index).to(tl.int64)
    if GATHER:
        src = src_ptr + block_id * stride_src
        dst = dst_ptr + index * stride_dst
    else:
        src = src_ptr + index * stride_src
        dst = dst_ptr + block_id * stride_dst
    data = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, data.to(dst_ptr.dtype.element_ty), mask=mask)


def _block_contiguous(t: torch.Tensor) -> bool:
    """Each ``t[i]`` is one dense run of memory."""
    return t[0].is_contiguous() if t.shape[0] else True


def _copy(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    staging, cache = (dst, src) if gather else (src, dst)
    if staging.shape[1:] != cache.shape[1:] or staging.shape[0] != block_ids.shape[0]:
        raise ValueError(
            f"staging {tuple(staging.shape)} does not hold {block_ids.shape[0]} blocks of "
            f"kv_cache {tuple(cache.shape)}"
        )
    if not (_block_contiguous(src) and _block_contiguous(dst)):
        raise ValueError("every block of kv_cache and staging must be contiguous")
    if block_ids.shape[0] == 0:
        return
    require_runnable(_copy_blocks_kernel, src, dst, block_ids)
    block_ids = block_ids.contiguous()  # read with element stride 1
    block_numel = cache[0].numel()
    grid = (block_ids.shape[0], cdiv(block_numel, CHUNK))
    _copy_blocks_kernel[grid](
        src, dst, block_ids, src.stride(0), dst.stride(0), block_numel, GATHER=gather, CHUNK=CHUNK
    )


def gather_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int32/int64, on kv_cache's device
    out: torch.Tensor | None = None,  # [n, 2, block_size, H, D]
) -> torch.Tensor:
    """Copy blocks out of the paged cache into one contiguous staging tensor (converting to
    ``out``'s dtype). Block ids must be in range (not checked: that would cost a sync)."""
    if out is None:
        out = torch.empty(
            (block_ids.shape[0], *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device
        )
    _copy(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks(
    staging: torch.Tensor,  # [n, 2, block_size, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int32/int64, distinct, on kv_cache's device
) -> None:
    """Copy a contiguous staging tensor into the given blocks of the paged cache (converting
    to the cache's dtype)."""
    _copy(staging, kv_cache, block_ids, gather=False)
