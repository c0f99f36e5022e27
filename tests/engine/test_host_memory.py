"""Huge-page-backed host tensors: zeroed, aligned, and on huge pages where THP allows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.host_memory import HUGE_PAGE_BYTES, huge_page_bytes, zeros_on_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_allowed() -> bool:
    return THP_MODE.exists() and "[never]" not in THP_MODE.read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensor_is_zeroed_aligned_and_writable(dtype):
    shape = (40, 2, 16, 8, 128)  # 40 blocks of 16 tokens x 8 heads x 128 dims
    tensor = zeros_on_huge_pages(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not tensor.any()
    tensor[3, 1].fill_(1.5)
    assert tensor.sum().item() == pytest.approx(1.5 * 16 * 8 * 128)


def test_small_tensor_is_an_ordinary_zeroed_tensor():
    tensor = zeros_on_huge_pages((4, 2, 4, 2, 16), torch.float32)
    assert tensor.shape == (4, 2, 4, 2, 16) and not tensor.any()


@pytest.mark.skipif(not thp_allowed(), reason="transparent huge pages are off on this host")
def test_pages_are_huge_where_the_kernel_allows():
    plain = torch.zeros(32 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    huge = zeros_on_huge_pages((32 * HUGE_PAGE_BYTES,), torch.uint8)
    # In "madvise" mode (the common default) only the advised tensor gets huge pages; a
    # fragmented host may back fewer than all of them, but not none.
    assert huge_page_bytes(huge) >= 8 * HUGE_PAGE_BYTES
    if "[madvise]" in THP_MODE.read_text():
        assert huge_page_bytes(plain) < huge_page_bytes(huge)
