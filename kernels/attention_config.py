"""Launch shapes of the paged-attention kernel, and how many KV splits a decode batch gets.

Two launches serve one batch: single-token (decode) segments, memory-bound, want few rows per
program and many programs in flight; prefill chunks, compute-bound, want large row blocks for
the tensor cores. The numbers here were tuned on an H100 (``benchmarks/kernels.py``) for
fp16/bf16, the deep prefill shape on an H200 (the same SMs); shapes that need more shared
memory than every GPU has are chosen by the device's opt-in limit, not by its name. fp32
on a GPU is for tests, not speed: compiled for sm_90, its launch shapes spill registers
(decode ~0.8 KB per thread, prefill an 8 KB stack frame; ``ptxas``, not timed), and the
head_dim 256 fp32 prefill needs 140 KB of shared memory, more than sm_86/sm_89 GPUs have
(~99 KB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.intmath import cdiv
from kernels.triton_utils import next_pow2

# Split-KV: aim for this many programs per SM, and give each split at least this many tiles
# (a split's fixed cost is its q load and one partial row written and merged). On the H100,
# batch 64 at 2k-8k was fastest unsplit (512 programs), batch 16 with 2 splits, batch 1 with
# 16-32.
DECODE_PROGRAMS_PER_SM = 2
MIN_TILES_PER_SPLIT = 2
MAX_KV_SPLITS = 32
INTERPRETER_NUM_SMS = 4
# Prefill chunks of at least DEEP_PREFILL_MIN_TOKENS rows take 256-row programs, 64-key
# tiles, 8 warps and 4 stages where a program may have DEEP_PREFILL_SMEM_BYTES of shared
# memory: Q (64 KB in bf16) and 4 stages of K/V tiles (128 KB). Measured on an H200
# (Hopper: same SMs as the H100) with heads-fastest program order: 110 us at 2k tokens
# against 119 us for the 64-row shape, 1362 us at 8k against 1411 for the 128-row one.
DEEP_PREFILL_MIN_TOKENS = 2048
DEEP_PREFILL_SMEM_BYTES = 200 * 1024


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """One launch's tile shape. ``block_m`` rows = query tokens x the query heads of one KV
    head (at least the GQA group size, a power of two); ``tile_n`` keys per inner step."""

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            value = getattr(self, name)
            if value < 16 or value != next_pow2(value):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def decode_config(head_dim: int, dtype: torch.dtype, num_queries_per_kv: int) -> LaunchConfig:
    """Single-token segments: one row per query head of the group."""
    block_m = max(16, next_pow2(num_queries_per_kv))
    wide = next_pow2(head_dim) > 128 or dtype == torch.float32
    return LaunchConfig(block_m, tile_n=32 if wide else 64, num_warps=4, num_stages=2)


def prefill_config(
    head_dim: int,
    dtype: torch.dtype,
    num_queries_per_kv: int,
    num_tokens: int,
    smem_bytes: int = 0,
) -> LaunchConfig:
    """Prompt chunks: 256 rows with 8 warps and a 4-deep pipeline from 2k rows where the GPU
    has ``smem_bytes`` (per program, opt-in) for it (~192 KB: Hopper, datacenter Blackwell).
    Elsewhere 64 rows per program up to 4k rows, where more, smaller programs balance the
    causal triangle's uneven work across the SMs, and 128 above."""
    wide = next_pow2(head_dim) > 128 or dtype == torch.float32
    if wide:
        return LaunchConfig(max(64, next_pow2(num_queries_per_kv)), 32, 4, 2)
    if num_tokens >= DEEP_PREFILL_MIN_TOKENS and smem_bytes >= DEEP_PREFILL_SMEM_BYTES:
        return LaunchConfig(max(256, next_pow2(num_queries_per_kv)), 64, 8, 4)
    if num_tokens <= 4096:
        return LaunchConfig(max(64, next_pow2(num_queries_per_kv)), 64, 4, 2)
    return LaunchConfig(max(128, next_pow2(num_queries_per_kv)), 32, 4, 2)


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def device_smem_bytes(device: torch.device) -> int:
    """Shared memory one program may opt into (0 off CUDA: the interpreter has no limit
    worth tuning for)."""
    if device.type != "cuda":
        return 0
    properties = torch.cuda.get_device_properties(device)
    return getattr(properties, "shared_memory_per_block_optin", 0)


def num_kv_splits(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, tile_n: int, num_sms: int
) -> int:
    """Splits per decode segment (a power of two): enough programs to fill the GPU when the
    batch is small and contexts long, never so many that a split has under
    ``MIN_TILES_PER_SPLIT`` tiles."""
    programs = num_decodes * num_kv_heads
    if programs == 0:
        return 1
    wanted = cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)
    most = cdiv(max_seq_len, tile_n) // MIN_TILES_PER_SPLIT
    splits = max(1, min(wanted, most, MAX_KV_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two
