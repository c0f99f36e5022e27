"""Launch-shape choices (``kernels/attention_config.py``): pure functions of the shapes and
the device, checked without launching anything."""

import torch

from kernels.attention_config import (
    DEEP_PREFILL_SMEM_BYTES,
    LaunchConfig,
    num_kv_splits,
    prefill_config,
)

H100_SMEM_OPTIN = 227 * 1024
ADA_SMEM_OPTIN = 99 * 1024


def test_long_prompts_take_the_deep_shape_only_where_its_shared_memory_fits():
    """256 rows x (Q + 4 stages of 64-key K/V tiles) in bf16 is ~192 KB: Hopper has it,
    sm_89 (99 KB) does not and keeps the shapes that fit every GPU."""
    deep = prefill_config(128, torch.bfloat16, 4, 8192, smem_bytes=H100_SMEM_OPTIN)
    assert deep == LaunchConfig(256, 64, 8, 4)
    q_bytes = deep.block_m * 128 * 2
    kv_bytes = deep.num_stages * 2 * deep.tile_n * 128 * 2
    assert q_bytes + kv_bytes <= DEEP_PREFILL_SMEM_BYTES <= H100_SMEM_OPTIN
    assert prefill_config(128, torch.bfloat16, 4, 8192, smem_bytes=ADA_SMEM_OPTIN) == (
        LaunchConfig(128, 32, 4, 2)
    )
    assert prefill_config(128, torch.bfloat16, 4, 8192) == LaunchConfig(128, 32, 4, 2)


def test_short_prompts_wide_heads_and_fp32_keep_their_shapes():
    assert prefill_config(128, torch.bfloat16, 4, 2048, H100_SMEM_OPTIN).block_m == 256
    for smem in (0, H100_SMEM_OPTIN):
        assert prefill_config(128, torch.bfloat16, 4, 2047, smem) == LaunchConfig(64, 64, 4, 2)
        assert prefill_config(256, torch.bfloat16, 4, 8192, smem) == LaunchConfig(64, 32, 4, 2)
        assert prefill_config(128, torch.float32, 4, 8192, smem) == LaunchConfig(64, 32, 4, 2)
    # A GQA group wider than the rows still gets one row per query head of the group.
    assert prefill_config(128, torch.bfloat16, 512, 8192, H100_SMEM_OPTIN).block_m == 512


def test_kv_splits_fill_the_gpu_at_small_batch_and_stay_a_power_of_two():
    assert num_kv_splits(64, 8, 8192, 64, 132) == 1  # 512 programs: enough
    assert num_kv_splits(16, 8, 2048, 64, 132) == 2
    assert num_kv_splits(1, 8, 8192, 64, 132) == 32
    assert num_kv_splits(1, 8, 128, 64, 132) == 1  # 2 tiles: no split below 2 tiles each
    assert num_kv_splits(0, 8, 8192, 64, 132) == 1
