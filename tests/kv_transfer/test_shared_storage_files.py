"""The block-file format and the shared-storage connector in one process."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from common.hashing import hash_blocks
from kv_transfer import CorruptBlockError, KVTransferConfig, LayoutMismatchError, PeerRef
from kv_transfer.blockfile import MAGIC, read_block_file, write_block_file
from kv_transfer.errors import BlockNotFoundError, FetchAbortedError, TransferFailedError
from kv_transfer.layout import KVLayout
from kv_transfer.shared_storage import SharedStorageConnector
from tests.support.processes import ROOT

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
HASH = hashlib.sha256(b"block").digest()


def payload() -> bytearray:
    return bytearray(os.urandom(LAYOUT.block_bytes))


def test_round_trip_and_no_temp_files_left(tmp_path):
    data = payload()
    path = tmp_path / "b.kvblock"
    write_block_file(path, LAYOUT, HASH, memoryview(data))
    out = bytearray(LAYOUT.block_bytes)
    read_block_file(path, LAYOUT, HASH, memoryview(out))
    assert out == data
    assert [p.name for p in tmp_path.iterdir()] == ["b.kvblock"]
    assert path.read_bytes().startswith(MAGIC)


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:-1],  # truncated
        lambda raw: raw + b"x",  # trailing garbage
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # one payload bit
        lambda raw: b"NOTAKVB!" + raw[8:],  # magic
        lambda raw: raw[:8] + b"\xff\xff\x00\x00" + raw[12:],  # header length
        lambda raw: raw[:14] + bytes([raw[14] ^ 0xFF]) + raw[15:],  # header bytes
    ],
)
def test_damaged_files_are_refused(tmp_path, damage):
    path = tmp_path / "b.kvblock"
    write_block_file(path, LAYOUT, HASH, memoryview(payload()))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises((CorruptBlockError, LayoutMismatchError)):
        read_block_file(path, LAYOUT, HASH, memoryview(bytearray(LAYOUT.block_bytes)))


def test_wrong_block_and_wrong_layout_are_refused(tmp_path):
    path = tmp_path / "b.kvblock"
    write_block_file(path, LAYOUT, HASH, memoryview(payload()))
    out = memoryview(bytearray(LAYOUT.block_bytes))
    with pytest.raises(CorruptBlockError, match="holds block"):
        read_block_file(path, LAYOUT, hashlib.sha256(b"other").digest(), out)
    other = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    with pytest.raises(LayoutMismatchError):
        read_block_file(path, other, HASH, out)


SHAPE = (16, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)  # 16 blocks


def two_workers(tmp_path, config: KVTransferConfig | None = None):
    """Connectors of two workers on one shared directory, registered on random source
    and zeroed destination caches: (a, b, src, dst)."""
    config = config or KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path))
    src = [torch.randn(SHAPE).half() for _ in range(2)]
    dst = [torch.zeros(SHAPE).half() for _ in range(2)]
    a, b = SharedStorageConnector(config, "a"), SharedStorageConnector(config, "b")
    a.register_kv_caches(src)
    b.register_kv_caches(dst)
    return a, b, src, dst


def _export(connector: SharedStorageConnector, lease: str, block_ids, hashes) -> None:
    connector.export_blocks(lease, block_ids, hashes)
    deadline = time.monotonic() + 10
    while lease not in connector.poll_finished_exports():
        assert time.monotonic() < deadline, "export never finished"
        time.sleep(0.01)


def test_connector_stores_a_prefix_other_workers_can_load(tmp_path):
    hashes = hash_blocks(list(range(3 * LAYOUT.block_size)), LAYOUT.block_size, salt="t")
    a, b, src, dst = two_workers(tmp_path)
    with a, b:
        assert b.lookup_prefix(hashes) == 0
        _export(a, "lease", [5, 6], hashes[:2])  # written: the lease may go now
        assert b.lookup_prefix(hashes) == 2
        b.start_fetch("f", PeerRef("a", "unused"), [5, 6], [1, 9], hashes[:2])
        b.wait("f", 10)
        for layer in range(2):
            assert torch.equal(dst[layer][[1, 9]], src[layer][[5, 6]])


def test_a_bad_stored_file_never_blocks_its_prefix_for_good(tmp_path):
    """A file truncated by a crash or a full disk is rewritten by the next export of its
    block; one that fails a reader's checks is removed; a worker of another KV dtype on
    the same volume keeps apart instead of failing on these files."""
    hashes = hash_blocks(list(range(2 * LAYOUT.block_size)), LAYOUT.block_size, salt="t")
    a, b, src, dst = two_workers(tmp_path)
    with a, b:
        _export(a, "first", [5, 6], hashes)
        path = a.path_for(hashes[0])
        path.write_bytes(path.read_bytes()[:-7])  # truncated
        _export(a, "again", [5, 6], hashes)
        b.start_fetch("f", PeerRef("a", "unused"), [5, 6], [1, 9], hashes)
        b.wait("f", 10)
        for layer in range(2):
            assert torch.equal(dst[layer][[1, 9]], src[layer][[5, 6]])
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 1  # one payload bit: whole by its size, wrong by its checksum
        path.write_bytes(bytes(raw))
        b.start_fetch("g", PeerRef("a", "unused"), [5], [2], hashes[:1])
        with pytest.raises(CorruptBlockError):
            b.wait("g", 10)
        assert not path.exists() and b.lookup_prefix(hashes) == 0
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path))
    with SharedStorageConnector(config, "c") as c:
        c.register_kv_caches([torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(2)])
        assert c.root != a.root and c.lookup_prefix(hashes) == 0


_FULL_DISK_EXPORTER = """
import resource, signal, sys, time
import torch
from kv_transfer import KVTransferConfig
from kv_transfer.shared_storage import SharedStorageConnector
from tests.support.processes import ROOT
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # a disk with room for nothing
shape = (16, 2, 4, 2, 8)
# One block per chunk, one I/O thread: the first chunk fails, the others are skipped.
config = KVTransferConfig(connector="shared_storage", shared_dir=sys.argv[1],
                          staging_bytes=2 * 4 * 2 * 8 * 2 * 2, io_threads=1)
with SharedStorageConnector(config, "full") as connector:
    connector.register_kv_caches([torch.randn(shape).half() for _ in range(2)])
    connector.export_blocks("lease", [5, 6, 7], [bytes.fromhex(h) for h in sys.argv[2:]])
    while "lease" not in connector.poll_finished_exports():
        time.sleep(0.01)
"""


_READ_ONLY_REGISTRATION = """
import sys, torch
from common.config_base import ConfigError
from kv_transfer import KVTransferConfig
from kv_transfer.shared_storage import SharedStorageConnector
config = KVTransferConfig(connector="shared_storage", shared_dir=sys.argv[1])
SHAPE = tuple(int(size) for size in sys.argv[2:])
try:
    SharedStorageConnector(config, "ro").register_kv_caches(
        [torch.zeros(SHAPE).half() for _ in range(2)])
except ConfigError as exc:
    sys.exit(str(exc))
"""


@pytest.mark.parametrize("made", [True, False])
def test_a_directory_the_worker_cannot_write_to_fails_its_start(tmp_path, made):
    """A shared directory this worker may not write (a read-only mount, another user's)
    is refused at registration, naming the key. It registered: every hand-off then failed
    to write, with no marker either, and each reader waited out ``timeout_s``. A real
    kernel refusal: a child without root's capabilities (``setpriv``) on a 0555 dir."""
    if made:  # an operator's existing dir, with its layout dir even
        config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path))
        with SharedStorageConnector(config, "a") as writer:
            writer.register_kv_caches([torch.zeros(SHAPE).half() for _ in range(2)])
    os.chmod(tmp_path, 0o555)
    for path in tmp_path.rglob("*"):
        os.chmod(path, 0o555)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: no way to be refused a write")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    child = subprocess.run(
        [*prefix, sys.executable, "-c", _READ_ONLY_REGISTRATION, str(tmp_path), *map(str, SHAPE)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    for path in [tmp_path, *tmp_path.rglob("*")]:
        os.chmod(path, 0o755)  # (for the cleanup, without root)
    assert child.returncode == 1, child.stderr
    assert "kv_transfer.shared_dir" in child.stderr and "cannot write" in child.stderr


def test_a_block_the_exporter_could_not_write_fails_its_readers_at_once(tmp_path):
    """An exporter on a full disk (a real kernel limit: RLIMIT_FSIZE in a child process)
    leaves a failure marker per block of the transfer; the transfer's reader fails fast
    instead of waiting out its timeout, and another transfer of the block is not failed."""
    hashes = hash_blocks(list(range(3 * LAYOUT.block_size)), LAYOUT.block_size, salt="full")
    child = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_EXPORTER, str(tmp_path), *(h.hex() for h in hashes)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              timeout_s=30.0)  # fmt: skip
    a, b, src, dst = two_workers(tmp_path, config)
    with a, b:
        started = time.monotonic()
        # The last block: its chunk was skipped after the first failed, not tried.
        b.start_fetch("lease", PeerRef("full", "unused"), [7], [1], hashes[2:])
        with pytest.raises(TransferFailedError, match="could not write"):
            b.wait("lease", 30)
        assert time.monotonic() - started < 5  # not the 30 s timeout
        assert len(list(tmp_path.rglob("*.failed"))) == 3  # one per block of the export
        # Another transfer of a block the full disk failed: its reader waits for this
        # export's file (the old marker, per block, failed it at once though the file came).
        b.start_fetch("later", PeerRef("a", "unused"), [2], [1], hashes[1:2])
        time.sleep(0.2)
        _export(a, "later", [2], hashes[1:2])
        b.wait("later", 10)
        assert all(torch.equal(dst[layer][1], src[layer][2]) for layer in range(2))


def test_a_fetch_given_up_stops_waiting_for_files_that_never_come(tmp_path):
    """An export released before it was written leaves its readers waiting for files that
    never come; a reader whose request is gone gives up at once instead of holding an I/O
    thread (here the only one) until its deadline. Still reported once, as failed."""
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              timeout_s=30.0, io_threads=1)  # fmt: skip
    hashes = hash_blocks(list(range(2 * LAYOUT.block_size)), LAYOUT.block_size, salt="gone")
    a, b, src, dst = two_workers(tmp_path, config)
    with a, b:
        b.start_fetch("never", PeerRef("a", "unused"), [5], [1], hashes[:1])
        time.sleep(0.2)  # waiting for the file
        started = time.monotonic()
        b.abort_fetch("never")
        b.abort_fetch("unknown")  # a no-op
        with pytest.raises(FetchAbortedError):
            b.wait("never", 30)
        assert time.monotonic() - started < 2  # not the 30 s timeout
        assert b.num_active_fetches == 0 and not b.poll_fetches()  # reported once
        _export(a, "stored", [6], hashes[1:])  # the I/O thread serves the next fetch
        b.start_fetch("next", PeerRef("a", "unused"), [6], [2], hashes[1:])
        b.abort_fetch("next")  # the file is there: nothing to wait for, it lands
        b.wait("next", 10)
        assert all(torch.equal(dst[layer][2], src[layer][6]) for layer in range(2))


def test_fetches_waiting_on_a_dead_exporter_do_not_hold_back_others(tmp_path):
    """An exporter that froze or died never writes its files; its fetches wait for them
    until their deadline. Meanwhile a fetch whose files are on disk lands at once: the
    waiting holds no I/O thread (both held, it queued behind them past its deadline)."""
    timeout_s = 6.0
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              timeout_s=timeout_s, io_threads=2)  # fmt: skip
    hashes = hash_blocks(list(range(4 * LAYOUT.block_size)), LAYOUT.block_size, salt="dead")
    a, b, src, dst = two_workers(tmp_path, config)
    with a, b:
        for i in range(3):  # more waiting chunks than I/O threads
            b.start_fetch(f"dead-{i}", PeerRef("dead", "unused"), [i], [i], hashes[i : i + 1])
        time.sleep(0.2)  # they are waiting for their files
        _export(a, "stored", [9], hashes[3:])
        started = time.monotonic()
        b.start_fetch("healthy", PeerRef("a", "unused"), [9], [12], hashes[3:])
        b.wait("healthy", 30)
        elapsed_s = time.monotonic() - started
        assert elapsed_s < timeout_s / 3, f"the healthy fetch waited {elapsed_s:.1f} s"
        assert all(torch.equal(dst[layer][12], src[layer][9]) for layer in range(2))
        for i in range(3):
            with pytest.raises(BlockNotFoundError):
                b.wait(f"dead-{i}", 30)
        assert b.num_active_fetches == 0 and not b.poll_fetches()


def test_other_tensor_parallel_layouts_are_no_mismatch_another_dtype_is(tmp_path):
    """Rank 1 of 2 waits for its own file of a block while rank 0's is there already (its
    exporter was quicker); a single-rank worker waits too, past files of an earlier TP-2
    deployment (stale: one deployment's roles share a size). Another dtype is a mismatch."""
    import dataclasses

    base = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path), timeout_s=5)
    hashes = hash_blocks(list(range(LAYOUT.block_size)), LAYOUT.block_size, salt="tp")
    others = hash_blocks(list(range(LAYOUT.block_size)), LAYOUT.block_size, salt="other")
    src = [torch.randn(SHAPE).half() for _ in range(2)]

    def connector(name: str, dtype=torch.float16, **tp) -> SharedStorageConnector:
        made = SharedStorageConnector(dataclasses.replace(base, **tp), name)
        caches = src if name.startswith("exporter") else [torch.zeros(SHAPE) for _ in range(2)]
        made.register_kv_caches([cache.to(dtype) for cache in caches])
        return made

    with connector("exporter0", tp_size=2, tp_rank=0) as exporter0, \
         connector("exporter1", tp_size=2, tp_rank=1) as exporter1, \
         connector("fetcher1", tp_size=2, tp_rank=1) as fetcher1, \
         connector("exporter") as single_exporter, connector("single") as single, \
         connector("wide", dtype=torch.float32) as wide:  # fmt: skip
        _export(exporter0, "lease", [3], hashes)
        for fetcher, peer in ((fetcher1, "exporter1"), (single, "exporter")):
            fetcher.start_fetch("f", PeerRef(peer, "unused"), [3], [1], hashes)
        time.sleep(0.3)  # each waits on its own layout's file, not failing on rank 0's
        assert not fetcher1.poll_fetches() and not single.poll_fetches()
        _export(exporter1, "lease", [3], hashes)
        _export(single_exporter, "lease", [3], hashes)
        fetcher1.wait("f", 5)
        single.wait("f", 5)
        assert all(torch.equal(single.kv.tensors[layer][1], src[layer][3]) for layer in range(2))
        wide.start_fetch("g", PeerRef("exporter", "unused"), [4], [1], others)
        _export(single_exporter, "lease2", [4], others)  # float16, where wide is float32
        with pytest.raises(LayoutMismatchError):
            wide.wait("g", 5)


def test_a_missing_block_does_not_hide_the_failure_markers_after_it(tmp_path):
    """A chunk's files were checked in order: one missing without a marker (a sweep took
    it) hid the markers of every later block, and the fetch waited out its deadline. And
    every prefix directory is made at registration, so that a marker fits on a full disk
    (a new directory needs a data block)."""
    from kv_transfer.shared_storage import _leave_failure_marker

    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              timeout_s=30.0)  # fmt: skip
    hashes = hash_blocks(list(range(3 * LAYOUT.block_size)), LAYOUT.block_size, salt="hid")
    a, b, _, _ = two_workers(tmp_path, config)
    with a, b:
        assert sorted(d.name for d in b.root.iterdir()) == [f"{i:02x}" for i in range(256)]
        for block_hash in hashes[1:]:
            _leave_failure_marker(b.path_for(block_hash), "t")
        started = time.monotonic()
        b.start_fetch("t", PeerRef("a", "unused"), [5, 6, 7], [1, 2, 3], hashes)
        with pytest.raises(TransferFailedError, match="could not write"):
            b.wait("t", 30)
        assert time.monotonic() - started < 5  # not the 30 s timeout


def test_a_namespace_removed_under_a_fetch_is_a_wait_not_a_failure(tmp_path):
    """The directory removed (an operator's cleanup): the check for other layouts raised
    FileNotFoundError, and every fetch failed at once with a traceback. It waits for the
    export, which makes the directories again."""
    hashes = hash_blocks(list(range(LAYOUT.block_size)), LAYOUT.block_size, salt="gone")
    a, b, src, dst = two_workers(tmp_path)
    with a, b:
        shutil.rmtree(b.namespace_dir)
        b.start_fetch("f", PeerRef("a", "unused"), [5], [1], hashes)
        time.sleep(0.3)
        assert b.num_active_fetches == 1  # still waiting
        _export(a, "f", [5], hashes)
        b.wait("f", 10)
        assert all(torch.equal(dst[layer][1], src[layer][5]) for layer in range(2))
