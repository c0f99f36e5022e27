"""Triton block gather/scatter against ``reference.gather_blocks`` / ``scatter_blocks``."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.block_copy import CHUNK, gather_blocks, scatter_blocks
from tests.kernels.triton_env import DEVICE


def random_cache(num_blocks: int, block_size: int = 16, heads: int = 2, dim: int = 64):
    return torch.randn(num_blocks, 2, block_size, heads, dim, device=DEVICE)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_gather_matches_reference(id_dtype):
    cache = random_cache(20, block_size=32, heads=4, dim=64)  # 16k elements: 4 chunks a block
    assert cache[0].numel() > CHUNK
    ids = torch.tensor([7, 0, 19, 3, 3, 11], dtype=id_dtype, device=DEVICE)
    expected = reference.gather_blocks(cache, ids.long())
    assert torch.equal(gather_blocks(cache, ids), expected)
    out = torch.full_like(expected, float("nan"))
    assert gather_blocks(cache, ids, out=out) is out
    assert torch.equal(out, expected)
    strided = torch.stack([ids, ids.flip(0)], 1)[:, 0]  # the same ids, element stride 2
    assert torch.equal(gather_blocks(cache, strided), expected)


def test_scatter_matches_reference_and_round_trips():
    cache = random_cache(12, heads=3, dim=80)  # odd sizes: a partial chunk
    ids = torch.tensor([5, 2, 9, 0], device=DEVICE)
    staging = torch.randn(4, *cache.shape[1:], device=DEVICE)
    expected = cache.clone()
    reference.scatter_blocks(staging, expected, ids)
    scatter_blocks(staging, cache, ids)
    assert torch.equal(cache, expected)
    assert torch.equal(gather_blocks(cache, ids), staging)


def test_scatter_converts_dtype():
    cache = random_cache(6).to(torch.float16)
    staging = torch.randn(2, *cache.shape[1:], device=DEVICE)
    ids = torch.tensor([4, 1], device=DEVICE)
    expected = cache.clone()
    reference.scatter_blocks(staging, expected, ids)
    scatter_blocks(staging, cache, ids)
    assert torch.equal(cache, expected)


def test_no_blocks():
    cache = random_cache(3)
    ids = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert gather_blocks(cache, ids).shape == (0, *cache.shape[1:])
    before = cache.clone()
    scatter_blocks(torch.empty(0, *cache.shape[1:], device=DEVICE), cache, ids)
    assert torch.equal(cache, before)


def test_rejects_bad_staging():
    cache = random_cache(4)
    ids = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="does not hold"):
        gather_blocks(cache, ids, out=torch.empty(3, *cache.shape[1:], device=DEVICE))
    strided = random_cache(4, heads=4)[:, :, :, :2]  # blocks with holes
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(strided, ids)
