"""Shared-storage connector: one file per block on a shared directory, named by block hash.

    <shared_dir>/<namespace>/<layout>/<hash[:2]>/<hash>.kvblock      (format: blockfile.py)

``<layout>`` names dtype, block size, layers, KV heads and head size (and the
tensor-parallel rank, whose KV heads a file holds), so workers of one
model with different KV layouts (a CPU float32 and a GPU bfloat16 deployment sharing a
volume) keep apart instead of failing on each other's files.

Because files are named by the chained prefix hash, the directory is also a cross-worker
prefix store: any worker with the same layout and namespace can load a block another one
wrote (``lookup_prefix`` counts how many leading blocks are stored). The exporter writes
the files on background threads and reports the export finished once they are on disk:
from then on the data lives in the files, not in its blocks, so the lease can go at once.
The fetcher waits for each file until the deadline (the exporter may still be writing)
or until the fetch is given up (``abort_fetch``), verifies it, and copies it into its
local block. The waiting is done by one thread (``file_waiter.py``) that hands a chunk to
the I/O threads once its files are all there: a chunk waiting on the I/O threads for an
exporter that froze or died held one until its deadline, and two of them held back every
other fetch. No handshake is needed: every file carries its layout, and the reader
checks it. An exporter rewrites a stored file that is not whole (truncated by a crash or
a full disk), and a reader removes a file that fails verification, so one bad file
cannot block a prefix for good. A block the exporter could not write (a full disk)
leaves an empty ``<name>.failed`` marker, so readers fail at once (and recompute)
instead of at their deadline; the next good write removes it. With
``shared_max_bytes`` the directory stays under that size, least recently used blocks
removed first (``storage_janitor.py``); a full disk frees a tenth of it, cap or not.

A transfer is cut into chunks that the I/O threads process in parallel (checksums and
copies release the GIL); each thread reuses one staging buffer, so steady-state transfers
allocate nothing. A transfer settles when its last chunk does, so a failed fetch is
reported only once no chunk can write its blocks any more.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import torch

from common.config_base import ConfigError
from kernels.reference import scatter_blocks
from kv_transfer.base import KVConnector
from kv_transfer.blockfile import (
    block_file_is_whole,
    read_block_file,
    read_block_header,
    write_block_file,
)
from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.errors import (
    BlockNotFoundError,
    ConnectorClosedError,
    CorruptBlockError,
    FetchAbortedError,
    KVTransferError,
    TransferFailedError,
)
from kv_transfer.file_waiter import FileWaiter
from kv_transfer.handshake import MetadataFetcher
from kv_transfer.layout import KVCaches
from kv_transfer.packing import as_bytes, block_id_tensor, gather_layers
from kv_transfer.records import ExportRecord, FetchRecord
from kv_transfer.storage_janitor import StorageJanitor, is_space_error, touch

logger = logging.getLogger(__name__)

_MAX_POLL_S = 0.02
_MAX_CHUNK_BYTES = 16 << 20

Items = list[tuple[int, bytes]]  # (block id, block hash)


def _failure_marker(path: Path, transfer_id: str) -> Path:
    """Where the export ``transfer_id`` says it could not write ``path`` (removed once
    written). Per transfer: a marker of the block alone, left by an export on a full disk,
    failed every later fetch of that block at once, though a later export wrote it."""
    tag = hashlib.sha256(transfer_id.encode()).hexdigest()[:16]
    return path.with_name(f"{path.name}.{tag}.failed")


def _leave_failure_marker(path: Path, transfer_id: str) -> None:
    """An empty marker (no data blocks needed, so it fits on a full disk: its directory
    is made at registration, as a new directory needs a block) that tells the readers
    waiting for ``path`` for ``transfer_id`` to give up now instead of at their
    deadline."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        _failure_marker(path, transfer_id).touch()


class _Countdown:
    """Settles a chunked transfer once, when its last chunk is done; keeps the first error.

    A chunk is done once its synchronous read (or write) has returned, or once it is known
    never to start, so a fetch that failed has no read left to land in its blocks
    (``tests/kv_transfer/test_late_reads.py``)."""

    def __init__(self, num_chunks: int, on_done: Callable[[KVTransferError | None], None]):
        self._lock = threading.Lock()
        self._remaining = num_chunks
        self._on_done = on_done
        self.error: KVTransferError | None = None

    def chunk_done(self, error: KVTransferError | None = None) -> None:
        with self._lock:
            self.error = self.error or error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._on_done(self.error)


def _check_writable(root: Path) -> None:
    """Make ``root`` and check this process may write there. A directory it may not
    write to (a read-only mount, another user's) failed no start: every hand-off then
    failed to write, and without a failure marker (unwritable too) every reader waited
    out ``timeout_s`` before computing the prompt itself. Any other error (a full disk)
    can pass, and the markers cover it."""
    probe = root / f".pdserve-write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ConfigError("kv_transfer.shared_dir",
                              f"this worker cannot write to {root}: {exc.strerror}"
                              ) from exc  # fmt: skip
        raise


class SharedStorageConnector(KVConnector):
    name = ConnectorName.SHARED_STORAGE

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        fetch_peer_metadata: MetadataFetcher | None = None,
    ) -> None:
        super().__init__(config, engine_id, fetch_peer_metadata)
        assert config.shared_dir is not None  # KVTransferConfig checks it
        self.namespace_dir = Path(config.shared_dir) / config.shared_namespace
        self.root = self.namespace_dir  # per layout once registered
        self._pool: ThreadPoolExecutor | None = None
        self._waiter: FileWaiter | None = None
        self._janitor: StorageJanitor | None = None
        self._local = threading.local()  # per I/O thread: its staging buffers

    def _needs_hashes(self) -> bool:
        return True

    def _on_register(self, kv: KVCaches) -> None:
        layout = kv.layout
        self.root = self.namespace_dir / (
            f"{layout.dtype}-b{layout.block_size}-l{layout.num_layers}"
            f"-h{layout.num_kv_heads}-d{layout.head_dim}"
            + (f"-tp{layout.tp_rank}of{layout.tp_size}" if layout.tp_size > 1 else "")
        )
        _check_writable(self.root)
        for prefix in range(256):  # so that a failure marker fits on a full disk (below)
            with contextlib.suppress(OSError):
                (self.root / f"{prefix:02x}").mkdir(exist_ok=True)
        self._pool = ThreadPoolExecutor(
            self.config.io_threads, thread_name_prefix=f"kv-storage-{self.engine_id}"
        )
        self._waiter = FileWaiter(f"kv-storage-wait-{self.engine_id}", _MAX_POLL_S)
        self._janitor = StorageJanitor(
            Path(self.config.shared_dir), self.config.shared_max_bytes,
            f"kv-janitor-{self.engine_id}",
        )  # fmt: skip

    def _transport_metadata(self) -> bytes:
        # Informational (no handshake is needed): lets an operator check both sides agree.
        return msgspec.msgpack.encode({"namespace": self.config.shared_namespace})

    def path_for(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}.kvblock"

    def lookup_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of this chain are stored (not verified until read)."""
        for i, block_hash in enumerate(block_hashes):
            if not self.path_for(block_hash).exists():
                return i
        return len(block_hashes)

    def _chunks(self, items: Items) -> list[Items]:
        per_chunk = min(self.config.staging_bytes, _MAX_CHUNK_BYTES) // self.layout.block_bytes
        per_chunk = max(1, per_chunk)
        return [items[i : i + per_chunk] for i in range(0, len(items), per_chunk)]

    def _buffer(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """This thread's reusable staging tensor ``name``, at least ``shape`` large."""
        layout = self.layout
        numel = 1
        for size in shape:
            numel *= size
        flat = getattr(self._local, name, None)
        if flat is None or flat.numel() < numel:
            flat = torch.empty(numel, dtype=layout.torch_dtype, device=device)
            setattr(self._local, name, flat)
        return flat[:numel].view(shape)

    def _submit(
        self,
        chunks: list[Items],
        work: Callable[[Items], None],
        countdown: _Countdown,
        skipped: Callable[[Items], None] | None = None,
    ):
        assert self._pool is not None

        def run(chunk: Items) -> None:
            try:
                if countdown.error is None:
                    work(chunk)
                elif skipped is not None:  # a failed transfer skips its remaining chunks
                    skipped(chunk)
            except KVTransferError as exc:
                countdown.chunk_done(exc)
            except Exception as exc:
                logger.exception("shared-storage chunk failed")
                countdown.chunk_done(TransferFailedError(f"{type(exc).__name__}: {exc}"))
            else:
                countdown.chunk_done()

        for chunk in chunks:
            self._pool.submit(run, chunk)

    # -- export: blocks -> files --------------------------------------------------------

    def _on_export(self, record: ExportRecord) -> None:
        assert record.block_hashes is not None
        tid = record.transfer_id
        # Engine thread: no file I/O here (checking thousands of stored files took ~0.25 s
        # on a local disk); the I/O threads skip the blocks already stored.
        chunks = self._chunks(list(zip(record.block_ids, record.block_hashes, strict=True)))
        if not chunks:
            self._exports.finish(tid)
            return

        def on_done(error: KVTransferError | None) -> None:
            if error is not None:
                logger.error("writing the blocks of export %s failed: %s", tid, error)
            # Finished either way: the blocks are no longer read for this transfer.
            self._exports.finish(tid)

        self._submit(
            chunks,
            lambda chunk: self._write_chunk(tid, chunk),
            _Countdown(len(chunks), on_done),
            lambda chunk: self._mark_unwritten(tid, chunk),
        )

    def _mark_unwritten(self, transfer_id: str, items: Items) -> None:
        """Leave failure markers for the blocks of an export's chunks skipped after one
        failed to write (a full disk fails the others too), so that their readers fail (and
        recompute) at once instead of holding an I/O thread until their deadline. A good
        write of the block removes its marker."""
        for _, block_hash in items:
            path = self.path_for(block_hash)
            if not path.exists():
                _leave_failure_marker(path, transfer_id)

    def _mark_used(self, path: Path) -> bool:
        """Under a cap, bump ``path``'s mtime so that the janitor removes it last (a
        metadata write each, which NFS pays for: skipped without a cap). False if the
        file is gone."""
        return touch(path) if self.config.shared_max_bytes else True

    def _is_stored(self, path: Path, block_hash: bytes) -> bool:
        return block_file_is_whole(path, self.layout, block_hash) and self._mark_used(path)

    def _write_chunk(self, transfer_id: str, items: Items) -> None:
        # Content-addressed: a whole file is already this block; marked used so that the
        # janitor keeps it for the reader (written again if it just removed it).
        items = [item for item in items if not self._is_stored(self.path_for(item[1]), item[1])]
        if not items:
            return
        layout, kv = self.layout, self.kv
        staging = self._buffer(
            "gather", (layout.num_layers, len(items), *layout.block_shape), kv.device
        )
        ids = block_id_tensor([block_id for block_id, _ in items], kv.device)
        with self._exports.reading(transfer_id) as export:
            if export is None:  # released meanwhile: its blocks may hold other data now
                return  # (no markers: another live export may be about to write these files)
            gather_layers(kv, range(layout.num_layers), ids, out=staging)  # [L, n, 2, bs, H, D]
        block = self._buffer("block", (layout.num_layers, *layout.block_shape), torch.device("cpu"))
        for j, (_, block_hash) in enumerate(items):
            block.copy_(staging[:, j])  # [L, 2, bs, H, D], the file's payload order
            path = self.path_for(block_hash)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)  # also if someone removed it
                write_block_file(path, layout, block_hash, as_bytes(block))
            except OSError as exc:  # a full disk, say
                _leave_failure_marker(path, transfer_id)
                # and the rest of the chunk, which will not be written either (its readers
                # waited out their deadline)
                self._mark_unwritten(transfer_id, items[j + 1 :])
                if is_space_error(exc) and self._janitor is not None:
                    self._janitor.note_space_error()
                raise
            _failure_marker(path, transfer_id).unlink(missing_ok=True)
            if self._janitor is not None:
                self._janitor.note_written(layout.block_bytes)

    # -- fetch: files -> blocks ---------------------------------------------------------

    def _on_fetch(self, record: FetchRecord) -> None:
        assert record.block_hashes is not None
        tid = record.transfer_id
        items = list(zip(record.local_block_ids, record.block_hashes, strict=True))
        chunks = self._chunks(items)
        if not chunks:
            self._fetches.complete(tid)
            return

        def on_done(error: KVTransferError | None) -> None:
            if error is None:
                self._fetches.complete(tid)
            else:
                self._fetches.fail(tid, error)

        countdown = _Countdown(len(chunks), on_done)
        read = lambda chunk: self._read_chunk(record, chunk)  # noqa: E731
        assert self._waiter is not None
        for chunk in chunks:
            self._waiter.add(
                self._chunk_ready(record, chunk, countdown),
                lambda chunk=chunk: self._submit([chunk], read, countdown),
                countdown.chunk_done,
                record.deadline,
            )

    def _chunk_ready(
        self, record: FetchRecord, items: Items, countdown: _Countdown
    ) -> Callable[[], bool]:
        """The waiter's check for one chunk: True once its files are all there (or the
        fetch already failed: the chunk has nothing left to do). Files found are not
        looked at again."""
        paths = [self.path_for(block_hash) for _, block_hash in items]
        found = polls = 0

        def ready() -> bool:
            nonlocal found, polls
            while found < len(paths) and countdown.error is None:
                if not self._file_ready(paths[found], record):
                    # A later block's failure marker fails the chunk now: one missing
                    # file with none of its own (removed by a sweep) hid them all, and
                    # the fetch waited out its deadline. (Every 8th poll: a stat per
                    # block is not free on NFS.)
                    polls += 1
                    for later in paths[found + 1 :] if polls % 8 == 1 else ():
                        if _failure_marker(later, record.transfer_id).exists():
                            raise TransferFailedError(f"the exporter could not write {later.name}")
                    return False
                found += 1
            return True

        return ready

    def _read_chunk(self, record: FetchRecord, items: Items) -> None:
        layout, kv = self.layout, self.kv
        shape = (len(items), layout.num_layers, *layout.block_shape)
        host = self._buffer("read", shape, torch.device("cpu"))  # [n, L, 2, bs, H, D]
        for j, (_, block_hash) in enumerate(items):
            path = self.path_for(block_hash)
            self._await_file(path, record)  # (there, unless the janitor just removed it)
            try:
                read_block_file(path, layout, block_hash, as_bytes(host[j]))
            except CorruptBlockError:
                path.unlink(missing_ok=True)  # the next export of this block writes it anew
                raise
            self._mark_used(path)
        staging = host if kv.device.type == "cpu" else host.to(kv.device)
        ids = block_id_tensor([block_id for block_id, _ in items], kv.device)
        for layer in range(layout.num_layers):
            scatter_blocks(staging[:, layer], kv.tensors[layer], ids)
        if kv.device.type == "cuda":
            torch.cuda.current_stream(kv.device).synchronize()

    def _await_file(self, path: Path, record: FetchRecord) -> None:
        delay = 0.001
        while not self._file_ready(path, record):
            time.sleep(min(delay, max(record.remaining_s(), 0.0)))
            delay = min(2 * delay, _MAX_POLL_S)

    def _file_ready(self, path: Path, record: FetchRecord) -> bool:
        """Whether ``path`` is there; raises if waiting for it is pointless."""
        if path.exists():
            return True
        if self._closed:
            raise ConnectorClosedError("connector closed")
        if self._fetches.is_aborted(record.transfer_id):
            # Its request is gone: stop waiting (and holding the request's blocks) for a
            # file that may never come (an export released unwritten).
            raise FetchAbortedError("the fetch was given up")
        if _failure_marker(path, record.transfer_id).exists():
            raise TransferFailedError(f"the exporter could not write {path.name}")
        self._check_other_layouts(path)
        if record.remaining_s() <= 0:
            raise BlockNotFoundError(f"{path.name} did not appear within the timeout")
        return False

    def _check_other_layouts(self, path: Path) -> None:
        """Raise ``LayoutMismatchError`` if the block was stored under another layout of
        this model (a peer configured with another dtype or block size): a clear error
        now rather than a missing file at the deadline. Files of another tensor-parallel
        layout are no mismatch. Another rank's file of our size means that rank's
        exporter was quicker. A file of another size is a stale one, left by an earlier
        deployment: both roles of one deployment have the same size (a config rule)."""
        relative = path.relative_to(self.root)
        ours = self.layout
        try:
            others = list(self.namespace_dir.iterdir())
        except (FileNotFoundError, NotADirectoryError):  # removed under us: the export
            return  # makes it again (it failed every fetch at once, with a traceback)
        for other in others:
            if other == self.root:
                continue
            found = read_block_header(other / relative)
            if found is None:
                continue
            theirs = found[0].layout
            if (theirs.tp_size, theirs.tp_rank) != (ours.tp_size, ours.tp_rank):
                continue
            ours.check_compatible(theirs)

    def _close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()  # fails what waits: before the pool, which runs the rest
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._janitor is not None:
            self._janitor.close()
