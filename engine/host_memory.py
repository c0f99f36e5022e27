"""Host (CPU DRAM) KV tensors backed by transparent huge pages.

Why: a CPU KV cache is large, lives as long as the process, and other processes read it.
The NIXL connector reads a peer's blocks with UCX ``cma`` (``process_vm_readv``), which
pins every page of every descriptor on every call; with 2 MiB pages instead of 4 KiB the
kernel walks 512x fewer pages. Measured on the 2-core CI host: +20-57% NIXL read
bandwidth (``benchmarks/results/kv_transfer_cpu.md``).

It is advice, not a requirement: where THP is off (``never``) or ``madvise`` fails, the
tensor is an ordinary allocation and only the speed differs.

The memory is an anonymous mapping, which the kernel hands out zeroed as each page is
first touched: nothing is written at allocation, so an engine starts in the same time
whatever its cache's size (a 1 GiB cache took 0.4-1.5 s to zero-fill, most of it in page
faults, on the CI host), and a cache holds memory as blocks are used (its first use of a
2 MiB page costs one fault, ~0.1 ms).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_MADV_HUGEPAGE = 14


def _madvise_hugepage(addr: int, num_bytes: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(num_bytes), _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor whose data starts on a 2 MiB boundary and whose
    pages the kernel is asked to back with transparent huge pages.

    The memory is a fresh anonymous mapping (zero by the kernel, faulted in on first
    touch); the advice is given before any touch, so the pages come in as huge pages.
    Costs up to 2 MiB of address space per tensor (the alignment slack); the tensor is a
    view of the mapping, which lives as long as the tensor's storage does.
    """
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes < HUGE_PAGE_BYTES:  # not worth the slack
        return torch.zeros(shape, dtype=dtype)
    # Private: Python's default for -1 is a shared mapping (shmem), which THP leaves alone.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=flags)  # zeroed on touch
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    _madvise_hugepage(raw.data_ptr() + offset, num_bytes - num_bytes % HUGE_PAGE_BYTES)
    return raw[offset : offset + num_bytes].view(dtype).view(shape)


def host_memory_bytes() -> int | None:
    """The memory this process may use: the host's physical memory, or its cgroup's
    limit (a container's, or any cgroup above it) where lower; None where neither is
    known."""
    limits = []
    with contextlib.suppress(ValueError, OSError):
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    limits += _cgroup_limits()
    return min(limits, default=None)


def _cgroup_limits(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> list[int]:
    """The memory limits of this process's cgroup and those above it (``/proc/self/cgroup``
    names it: the root's own files are another cgroup's unless a namespace made it ours),
    cgroup v2's ``memory.max`` or v1's ``memory.limit_in_bytes``."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    places = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2, unified
            places.append((root / path.lstrip("/"), root, "memory.max"))
        elif "memory" in controllers.split(","):  # v1
            base = root / "memory"
            places.append((base / path.lstrip("/"), base, "memory.limit_in_bytes"))
    limits = []
    for directory, top, name in places:
        while True:
            with contextlib.suppress(OSError, ValueError):
                text = (directory / name).read_text().strip()
                if text.isdigit() and int(text) < 1 << 60:  # ("max", or v1's "no limit")
                    limits.append(int(text))
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return limits


def zeros_for_kv_caches(
    num_layers: int,
    shape: tuple[int, ...],  # one layer's cache: [num_blocks, 2, block_size, H, D]
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """The engine's zeroed KV caches: per layer a [num_blocks, 2, block_size, H, D] view of
    one block-major [num_blocks, num_layers, 2, block_size, H, D] buffer.

    Why block-major: every layer of a block sits in one run of memory, so a transport that
    reads a peer's memory directly moves one region per block, not one per (layer, block)
    (NIXL: 8x fewer descriptors on an 8-layer model, +15-25% for scattered blocks at
    16-256 MB on the CI host, ``benchmarks/results/kv_transfer_cpu.md``). Attention and
    the block copies address a block through the layer's strides, so nothing else
    changes. On the CPU the buffer sits on huge pages (peers read it faster); elsewhere it
    is an ordinary allocation.
    """
    num_blocks, *block_shape = shape
    buffer = zeros_on_device(num_blocks, num_layers, *block_shape, dtype=dtype, device=device)
    return [buffer[:, layer] for layer in range(num_layers)]


def zeros_on_device(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor: on huge pages on the CPU, an ordinary allocation elsewhere."""
    if device.type == "cpu":
        return zeros_on_huge_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Huge-page bytes (``AnonHugePages`` in /proc/self/smaps) of the memory mappings that
    hold ``tensor``'s data; 0 where the kernel does not report it. For tests and
    diagnostics: a mapping may be larger than the tensor."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    inside = lo < end and start < hi
                elif inside and first == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
