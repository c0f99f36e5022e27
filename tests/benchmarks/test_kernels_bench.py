"""``benchmarks/kernels.py`` needs CUDA to time anything; its table and launch-shape lists
are checked here."""

from benchmarks import kernels
from benchmarks.kernels import Result, table
from kernels.attention_config import LaunchConfig


def test_table_rows_carry_bandwidth_the_contiguous_read_and_flops():
    decode = Result("decode", 16, 2048, 0.065, 0.060, 134e6, {}, 0.168, 0.0669)
    prefill = Result("prefill", 1, 2048, 0.134, 0.086, 34.4e9, {}, 0.131)
    unread = Result("decode", 16, 2048, 0.065, 0.060, 134e6, {})  # a sweep row: no read
    lines = table([decode, prefill, unread], peak=3.35e12).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == 12
    assert all(line.count("|") == 12 for line in lines[2:])
    # 134 MB in 65 us: 2.06 TB/s, 62% of 3.35; SDPA 60 us: 0.92 of our time.
    assert "| 2.06 TB/s (62%) | 2.23 TB/s (67%) | 0.92 | 168.0 | 66.9 | 1.03 |" in lines[2]
    assert "| 257 TFLOP/s | 400 TFLOP/s | 0.64 | 131.0 | - | - |" in lines[3]
    assert lines[4].endswith("| - | - |")


def test_target_sweep_shapes_are_launch_configs():
    """A bad shape would only fail on the GPU, after device time is spent. (All of them
    launched on an H200 on 2026-11-27: ``kernels_h200_prefill_order.md``.)"""
    for shape in kernels.TARGET_DECODE_SHAPES + kernels.TARGET_PREFILL_SHAPES:
        config = LaunchConfig(*shape)
        assert config.block_m >= 16 and config.num_warps in (2, 4, 8), shape
    assert {shape[0] for shape in kernels.TARGET_DECODE_SHAPES} == {16}  # one row per head


def test_the_mla_decode_table_reads_bandwidth_and_the_torch_ratio():
    """``benchmarks/mla_decode.py`` needs CUDA to time anything; its table is checked here."""
    from benchmarks.mla_decode import Row
    from benchmarks.mla_decode import table as mla_table

    # 16 x 8192 latents of 576 bf16: 151 MB in 50 us = 3.02 TB/s, 90% of 3.35.
    row = Row(16, 8192, 0.050, 0.060, 0.900, 16 * 8192 * 576 * 2)
    lines = mla_table([row], peak=3.35e12).splitlines()
    assert lines[0].count("|") == lines[2].count("|") == 8
    assert lines[2] == "| 16 | 8192 | 50.0 | 3.02 TB/s (90%) | 60.0 | 900.0 | 15.0x |"
