"""The shared directory under its size cap: least recently used block files go first, one
worker sweeps at a time, leftovers of dead writers go (with no cap too), and a connector
with a cap keeps the blocks it reads."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import torch

from common.hashing import hash_blocks
from kv_transfer import KVTransferConfig, PeerRef
from kv_transfer.storage_janitor import FRESH_S, LOCK_NAME, STALE_S, StorageJanitor, sweep
from tests.kv_transfer.test_shared_storage_files import LAYOUT, _export, two_workers


def _files(root: Path, count: int, size: int, age_s: float = 0.0) -> list[Path]:
    """``count`` block files of ``size`` bytes, oldest first (mtimes one second apart,
    the newest ``age_s`` old)."""
    now = time.time() - age_s
    paths = []
    for i in range(count):
        path = root / "ns" / "layout" / f"{i:02x}" / f"{i:064x}.kvblock"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        os.utime(path, (now - count + i, now - count + i))
        paths.append(path)
    return paths


def _stored(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvblock"))


def test_a_sweep_removes_the_least_recently_used_down_to_ninety_percent(tmp_path):
    paths = _files(tmp_path, 10, 1000)
    os.utime(paths[0])  # read just now: the most recently used
    result = sweep(tmp_path, 6000)
    assert result.scanned_bytes == 10_000 and not result.skipped
    assert _stored(tmp_path) <= 5400
    kept = [p for p in paths if p.exists()]
    assert kept == [paths[0], *paths[6:]]  # the oldest unused ones went
    assert sweep(tmp_path, 6000).removed_files == 0  # under the cap: nothing to do


def test_a_sweep_after_a_space_error_frees_a_tenth_without_a_cap(tmp_path):
    paths = _files(tmp_path, 20, 500, age_s=FRESH_S)
    result = sweep(tmp_path, None)
    assert result.removed_files == 2 and not paths[0].exists() and not paths[1].exists()
    assert all(p.exists() for p in paths[2:])


def test_a_space_error_sweep_keeps_the_blocks_just_written(tmp_path):
    """A disk full of other data: the oldest tenth of the few blocks stored was the
    hand-off an export had just written, and its reader waited out its deadline. Only
    where every block is young (a disk that fills within FRESH_S) do young ones go."""
    old = _files(tmp_path / "old", 2, 500, age_s=FRESH_S)
    young = _files(tmp_path / "young", 18, 500)
    result = sweep(tmp_path, None)
    assert result.removed_files == 2 and not any(p.exists() for p in old)
    assert all(p.exists() for p in young)
    assert sweep(tmp_path, None).removed_files == 2  # all young now: the oldest go


def test_the_filesystems_clock_says_what_is_stale(tmp_path, monkeypatch):
    """mtimes come from the file server's clock (NFS): a janitor whose host ran 11
    minutes fast removed a write's temp file and a fresh failure marker as stale."""
    directory = tmp_path / "ns" / "layout" / "ab"
    directory.mkdir(parents=True)
    live_tmp, live_marker = directory / ".ab.kvblock.1.tmp", directory / "cd.kvblock.x.failed"
    for path in (live_tmp, live_marker):
        path.write_bytes(b"")
    fast = time.time() + 660
    monkeypatch.setattr(time, "time", lambda: fast)
    monkeypatch.setattr(time, "time_ns", lambda: int(fast * 1e9))
    assert sweep(tmp_path, 1 << 30).removed_leftovers == 0
    assert live_tmp.exists() and live_marker.exists()


def test_leftovers_of_dead_writers_go_and_live_ones_stay(tmp_path):
    directory = tmp_path / "ns" / "layout" / "ab"
    directory.mkdir(parents=True)
    old = time.time() - STALE_S - 60
    stale_tmp, live_tmp = directory / ".ab.kvblock.1.tmp", directory / ".ab.kvblock.2.tmp"
    stale_marker, live_marker = directory / "cd.kvblock.failed", directory / "ef.kvblock.failed"
    for path in (stale_tmp, live_tmp, stale_marker, live_marker):
        path.write_bytes(b"")
    for path in (stale_tmp, stale_marker):
        os.utime(path, (old, old))
    sweep(tmp_path, 1 << 30)
    assert not stale_tmp.exists() and not stale_marker.exists()
    assert live_tmp.exists() and live_marker.exists()


def test_without_a_cap_leftovers_of_dead_writers_go_when_idle_and_blocks_stay(tmp_path):
    """No cap calls a sweep, so dead writers' temp files and markers stayed until the
    disk filled; an idle janitor now sweeps them every ``idle_sweep_s``."""
    blocks = _files(tmp_path, 3, 100)
    stale = blocks[0].parent / f".{blocks[0].name}.7.tmp"
    stale.write_bytes(b"x" * 100)
    old = time.time() - STALE_S - 60
    os.utime(stale, (old, old))
    assert sweep(tmp_path, 0).removed_leftovers == 1  # a sweep without a cap
    assert all(path.exists() for path in blocks)
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (old, old))
    janitor = StorageJanitor(tmp_path, 0, "test-janitor", idle_sweep_s=0.1)
    try:
        deadline = time.monotonic() + 10
        while stale.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not stale.exists()
        assert all(path.exists() for path in blocks)
    finally:
        janitor.close()
    assert not janitor._thread.is_alive()


def test_one_worker_sweeps_at_a_time(tmp_path):
    paths = _files(tmp_path, 4, 1000)
    with open(tmp_path / LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker is sweeping
        result = sweep(tmp_path, 1000)
    assert result.skipped and all(p.exists() for p in paths)
    assert sweep(tmp_path, 1000).removed_files == 4  # down to 900 bytes: every file


def test_a_capped_connector_keeps_the_blocks_it_reads(tmp_path):
    """Sixteen blocks exported one by one under a cap of about six files; the reader reads
    block 0 after each export. The directory ends under the cap with block 0 kept."""
    hashes = hash_blocks(list(range(16 * LAYOUT.block_size)), LAYOUT.block_size, salt="lru")
    file_bytes = LAYOUT.num_layers * LAYOUT.block_bytes + 512  # payload + header, about
    cap = 6 * file_bytes
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              shared_max_bytes=cap, timeout_s=5.0)  # fmt: skip
    a, b, src, dst = two_workers(tmp_path, config)
    with a, b:
        for i in range(16):
            _export(a, f"lease-{i}", [i], [hashes[i]])
            b.start_fetch(f"f{i}", PeerRef("a", "unused"), [0], [0], [hashes[0]])
            b.wait(f"f{i}", 10)
            time.sleep(0.02)  # coarse file timestamps: keep the order visible
        deadline = time.monotonic() + 10
        while _stored(tmp_path) > cap and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stored(tmp_path) <= cap
        assert a.path_for(hashes[0]).exists()  # read after every export: kept
        assert not a.path_for(hashes[1]).exists()  # never read again: among the first out
        assert a.path_for(hashes[15]).exists()  # the newest
        for layer in range(2):
            assert torch.equal(dst[layer][0], src[layer][0])
