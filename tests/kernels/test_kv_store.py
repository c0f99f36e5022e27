"""The Triton KV store against ``reference.store_kv``: bit-exact, slot by slot."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.kv_store import store_kv
from tests.kernels.triton_env import DEVICE


def random_cache(num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype):
    return torch.randn(num_blocks, 2, block_size, heads, dim).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype", "block_size", "heads", "dim"),
    [
        (torch.float32, torch.float32, 16, 2, 64),
        (torch.float16, torch.float16, 32, 8, 128),
        (torch.float32, torch.bfloat16, 64, 1, 64),  # converts on store
        (torch.float32, torch.float32, 16, 3, 80),  # head count and dim not powers of two
        (torch.float32, torch.float8_e4m3fn, 16, 2, 64),  # FP8: rounds, saturates
        (torch.bfloat16, torch.float8_e5m2, 32, 2, 64),
    ],
)
def test_store_matches_reference(src_dtype, cache_dtype, block_size, heads, dim):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 6, 40
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 17]] = -1  # padding tokens: skipped
    key = torch.randn(num_tokens, heads, dim, generator=gen).to(src_dtype).to(DEVICE)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(src_dtype).to(DEVICE)
    cache = random_cache(num_blocks, block_size, heads, dim, cache_dtype)
    expected = cache.clone()
    if cache_dtype in reference.FP8_DTYPES:
        largest = torch.finfo(cache_dtype).max
        key = key * (largest / 2)  # |x| > 2 sigma: past the format's range, saturated
        value = value * (largest / 1000)  # in range, rounded
        reference.store_kv(key, value, expected, slots.to(DEVICE))
        store_kv(key, value, cache, slots.to(DEVICE))
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
        keys = expected[:, 0].float()
        assert keys.isfinite().all() and keys.abs().max() == largest
        return
    reference.store_kv(key, value, expected, slots.to(DEVICE))
    store_kv(key, value, cache, slots.to(DEVICE))
    if cache_dtype != src_dtype and DEVICE.type == "cpu":
        # The interpreter truncates when narrowing (the GPU rounds to nearest): one ulp.
        torch.testing.assert_close(cache, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(cache, expected)


def test_store_from_fused_qkv_views():
    """The model hands over strided views of one fused projection."""
    tokens, heads, dim, block_size = 9, 2, 64, 16
    qkv = torch.randn(tokens, (4 + 2 * heads) * dim, device=DEVICE)
    _, key, value = qkv.split([4 * dim, heads * dim, heads * dim], dim=-1)
    key, value = key.view(tokens, heads, dim), value.view(tokens, heads, dim)
    assert not key.is_contiguous()
    slots = torch.arange(5, 5 + tokens, device=DEVICE)
    cache = random_cache(2, block_size, heads, dim, torch.float32)
    expected = cache.clone()
    reference.store_kv(key, value, expected, slots)
    store_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    # The slot mapping as a strided view too (every other element of a wider tensor).
    cache = random_cache(2, block_size, heads, dim, torch.float32)
    expected = cache.clone()
    reference.store_kv(key, value, expected, slots)
    store_kv(key, value, cache, torch.stack([slots, slots.flip(0)], 1)[:, 0])
    assert torch.equal(cache, expected)


def test_store_nothing():
    cache = random_cache(2, 16, 2, 64, torch.float32)
    before = cache.clone()
    empty = torch.empty(0, 2, 64, device=DEVICE)
    store_kv(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    skip_all = torch.randn(3, 2, 64, device=DEVICE)
    store_kv(skip_all, skip_all, cache, torch.full((3,), -1, device=DEVICE))
    assert torch.equal(cache, before)


def test_store_rejects_mismatched_shapes():
    cache = random_cache(2, 16, 2, 64, torch.float32)
    key = torch.randn(3, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        store_kv(key, key, cache, torch.arange(3, device=DEVICE))
