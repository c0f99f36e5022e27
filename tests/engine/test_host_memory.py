"""Huge-page-backed host tensors: zeroed, aligned, and on huge pages where THP allows; the
engine's KV caches as views of one block-major buffer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.host_memory import (
    HUGE_PAGE_BYTES,
    zeros_for_kv_caches,
    zeros_on_huge_pages,
)
from kv_transfer.layout import KVCaches

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
    """In a fresh process: in one that ran other tests, the plain tensor's mapping can
    hold memory an earlier test advised (a full CI run saw 92 MiB of huge pages there)."""
    script = (
        "import torch\n"
        "from engine.host_memory import HUGE_PAGE_BYTES, huge_page_bytes, zeros_on_huge_pages\n"
        "plain = torch.zeros(32 * HUGE_PAGE_BYTES, dtype=torch.uint8)\n"
        "huge = zeros_on_huge_pages((32 * HUGE_PAGE_BYTES,), torch.uint8)\n"
        "print(huge_page_bytes(huge))\n"  # nothing is resident before the first touch
        "huge.fill_(1)\n"
        "print(huge_page_bytes(plain), huge_page_bytes(huge))\n"
    )
    reply = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120, check=True)  # fmt: skip
    untouched, plain, huge = map(int, reply.stdout.split())
    assert untouched == 0
    # In "madvise" mode (the common default) only the advised tensor gets huge pages; a
    # fragmented host may back fewer than all of them, but not none.
    assert huge >= 8 * HUGE_PAGE_BYTES
    if "[madvise]" in THP_MODE.read_text():
        assert plain < huge


def test_kv_caches_are_layer_views_of_one_block_major_buffer():
    shape = (40, 2, 16, 8, 128)
    layers = zeros_for_kv_caches(3, shape, torch.float32, torch.device("cpu"))
    assert [tuple(layer.shape) for layer in layers] == [shape] * 3
    assert layers[0].data_ptr() % HUGE_PAGE_BYTES == 0 and not any(x.any() for x in layers)
    block_bytes = layers[0][0].numel() * 4
    for index, layer in enumerate(layers):  # block b of layer l: b * 3 + l blocks in
        assert layer.data_ptr() == layers[0].data_ptr() + index * block_bytes
        assert layer.stride(0) == 3 * layers[0][0].numel() and layer[0].is_contiguous()
    layers[1][7].fill_(2.0)  # one layer's block: no other layer or block sees it
    assert layers[1].sum().item() == 2.0 * layers[1][7].numel()
    assert not layers[0].any() and not layers[2].any()
    assert KVCaches.from_tensors(layers).block_major
