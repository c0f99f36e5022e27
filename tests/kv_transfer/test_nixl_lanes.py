"""NIXL read lanes: how a fetch is split, how many lanes, and that closing leaves no
thread behind. Transfers over lanes between processes are in test_transfer/test_faults
(the ``nixl_split`` connector name)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from common.config_base import ConfigError
from kv_transfer import KVTransferConfig
from kv_transfer.nixl import MAX_AUTO_LANES, lane_cpus, read_lane_count, split_parts
from tests.kv_transfer.pair import wired_pair


def indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    local = np.arange(n, dtype=np.int32)
    return local, np.arange(1000, 1000 + n, dtype=np.int32)


@pytest.mark.parametrize(
    ("num_descs", "num_lanes", "min_bytes", "expected_parts"),
    [
        (12, 3, 0, 3),  # no minimum: one part per lane
        (2, 3, 0, 2),  # never more parts than descriptors
        (12, 3, 4 * 100, 3),  # 1200 bytes, 400 per part at least: 3
        (12, 3, 5 * 100, 2),  # 1200 // 500 = 2
        (12, 3, 10_000, 1),  # smaller than the minimum: one part
        (12, 1, 0, 1),
    ],
)
def test_split_parts_counts(num_descs, num_lanes, min_bytes, expected_parts):
    local, remote = indices(num_descs)
    parts = split_parts(local, remote, num_lanes, 100, min_bytes)
    assert len(parts) == expected_parts
    # Order and pairing are kept: the parts put end to end are the input.
    assert np.array_equal(np.concatenate([p[0] for p in parts]), local)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), remote)
    sizes = [len(p[0]) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # balanced: every descriptor has the same size


def test_read_lane_count():
    assert read_lane_count(KVTransferConfig(nixl_read_lanes=3), "DRAM") == 3
    assert read_lane_count(KVTransferConfig(nixl_read_lanes=3), "VRAM") == 3
    assert read_lane_count(KVTransferConfig(), "VRAM") == 1
    assert 1 <= read_lane_count(KVTransferConfig(), "DRAM") <= MAX_AUTO_LANES
    with pytest.raises(ConfigError, match="nixl_read_lanes"):
        KVTransferConfig(nixl_read_lanes=-1)
    with pytest.raises(ConfigError, match="nixl_lane_min_bytes"):
        KVTransferConfig(nixl_lane_min_bytes=-1)


def test_lane_cpus_pins_dram_lanes_round_robin_over_the_allowed_cores():
    cpus = sorted(os.sched_getaffinity(0))
    pinned = lane_cpus(KVTransferConfig(), 5, "DRAM")
    assert pinned == [cpus[i % len(cpus)] for i in range(5)]
    assert lane_cpus(KVTransferConfig(), 1, "DRAM") == [None]  # nothing to spread
    assert lane_cpus(KVTransferConfig(), 3, "VRAM") == [None] * 3  # copy engines copy
    assert lane_cpus(KVTransferConfig(nixl_pin_lanes=False), 3, "DRAM") == [None] * 3


@pytest.mark.timeout(60)
def test_split_fetch_in_one_process_is_exact_and_close_leaves_no_threads():
    shape = (32, 2, 4, 2, 16)
    generator = torch.Generator().manual_seed(0)
    source = [torch.randn(shape, generator=generator) for _ in range(3)]
    dest = [torch.zeros(shape) for _ in range(3)]
    config = KVTransferConfig(timeout_s=10, nixl_read_lanes=3, nixl_lane_min_bytes=0)
    before = {t.name for t in threading.enumerate()}
    exporter, fetcher, peer = wired_pair(config, "lanes", source, dest)
    try:
        lanes = [t for t in threading.enumerate() if t.name.startswith("nixl-lanes-fetcher/read")]
        assert len(lanes) == 3
        cpus = sorted(os.sched_getaffinity(0))
        affinities = sorted(sorted(os.sched_getaffinity(t.native_id)) for t in lanes)
        assert affinities == sorted([cpus[i % len(cpus)]] for i in range(3))
        assert os.sched_getaffinity(0) == set(cpus)  # only the lane threads are pinned
        remote, local = [5, 9, 2, 30, 17], [0, 1, 2, 3, 31]
        exporter.export_blocks("t1", remote)
        fetcher.start_fetch("t1", peer, remote, local)
        fetcher.wait("t1", timeout_s=20)
        for src_layer, dst_layer in zip(source, dest, strict=True):
            assert torch.equal(dst_layer[local], src_layer[remote])
        untouched = [b for b in range(32) if b not in local]
        assert not dest[0][untouched].any()
        assert fetcher.num_active_fetches == 0
    finally:
        fetcher.close()
        exporter.close()
    leftover = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not [name for name in leftover if name.startswith("nixl")], leftover


def caches(block_major: bool, seed: int, shape=(32, 2, 4, 2, 16), num_layers=3):
    """Random per-layer caches: views of one block-major buffer, or separate tensors."""
    generator = torch.Generator().manual_seed(seed)
    if block_major:
        buffer = torch.randn((shape[0], num_layers, *shape[1:]), generator=generator)
        return [buffer[:, layer] for layer in range(num_layers)]
    return [torch.randn(shape, generator=generator) for _ in range(num_layers)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("exporter_block_major", "fetcher_block_major"),
    [(True, True), (True, False), (False, True), (False, False)],
)
def test_whole_block_descriptors_only_when_both_sides_are_block_major(
    exporter_block_major, fetcher_block_major
):
    """Both block-major: a READ lists one descriptor per block; otherwise one per (layer,
    block), whatever the mix. Every combination lands the same bytes."""
    source = caches(exporter_block_major, seed=1)
    dest = caches(fetcher_block_major, seed=2)
    before = [layer.clone() for layer in dest]
    config = KVTransferConfig(timeout_s=10, nixl_read_lanes=2, nixl_lane_min_bytes=0)
    exporter, fetcher, peer = wired_pair(config, "desc", source, dest)
    posted: list[int] = []
    try:
        assert fetcher.kv.block_major == fetcher_block_major
        for lane in fetcher._lanes:  # count the descriptors each READ lists
            prep = lane._agent.make_prepped_xfer

            def counted(op, local_dlist, local_indices, *rest, _prep=prep):
                posted.append(len(local_indices))
                return _prep(op, local_dlist, local_indices, *rest)

            lane._agent.make_prepped_xfer = counted
        remote, local = [5, 9, 2, 30, 17, 18], [0, 1, 2, 3, 31, 4]
        exporter.export_blocks("t1", remote)
        fetcher.start_fetch("t1", peer, remote, local)
        fetcher.wait("t1", timeout_s=20)
        per_block = 1 if exporter_block_major and fetcher_block_major else len(source)
        assert sum(posted) == len(remote) * per_block and len(posted) == 2
        for layer, (src, dst) in enumerate(zip(source, dest, strict=True)):
            assert torch.equal(dst[local], src[remote]), layer
            untouched = [b for b in range(32) if b not in local]
            assert torch.equal(dst[untouched], before[layer][untouched]), layer
        assert fetcher.num_active_fetches == 0
    finally:
        fetcher.close()
        exporter.close()
