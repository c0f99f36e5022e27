"""The connector interface: move KV blocks from an exporting engine to a fetching one.

Both worker roles hold one connector; the role lives in which half they call.

    prefill (exporter)                              decode (fetcher)
    ------------------                              ----------------
    register_kv_caches(kv_caches)                   register_kv_caches(kv_caches)
    metadata() -> bytes  --- gRPC GetTransferMetadata, via fetch_peer_metadata --->
    export_blocks(lease, block_ids, hashes)
          ... KVHandle(engine_id, endpoint, block_ids, num_tokens, lease) over gRPC ...
                                                    start_fetch(lease, peer, remote_ids,
                                                                local_ids, hashes)
                            <==== blocks move ====  poll_fetches() -> done / failed
    poll_finished_exports() -> [lease]  <- notified on completion or abort
    (lease expiry: release_export(lease))

Contract, for every transport:

* ``register_kv_caches`` once, before anything else; the tensors are kept by reference and
  must not be reallocated while the connector lives.
* ``metadata()`` is what a peer needs to reach us: our engine id, ``KVLayout``, capacity
  and the transport's own section. The fetching side checks the layout before moving any
  byte; a mismatch fails the fetch with ``LayoutMismatchError`` and nothing is written.
* ``export_blocks`` only records what a peer may pull under ``transfer_id``; it never
  blocks on the network. The exported blocks must stay untouched until the transfer id
  comes back from ``poll_finished_exports`` (the peer finished or gave up; for shared
  storage, the files are written) or the caller calls ``release_export`` (lease expired).
  After either, the connector has forgotten the export and never reads those blocks
  again. A fetcher gives up ``timeout_s`` after ``start_fetch``, so a lease longer than
  that plus the KVHandle's trip to the fetcher guarantees that no one-sided read (NIXL)
  races with the blocks' reuse; one still running then (late, below) may read reused
  blocks, but its fetch has failed whatever it reads.
* ``start_fetch`` never blocks (handshakes run on background threads). Each fetch is
  reported exactly once, by ``poll_fetches`` or by ``wait``: done means every local block
  holds the remote block's bytes, bit for bit, and the exporter's notification is on its
  way; failed carries a ``KVTransferError`` and means the local blocks hold undefined data
  that nothing writes any more, unless the fetch is also reported *late*. Every fetch
  settles within ``timeout_s`` of ``start_fetch``, provided ``fetch_peer_metadata``
  honours a deadline of its own (plus at most one in-progress copy on transports that
  copy synchronously).
* A late fetch (``FetchResults.late``; only NIXL: UCX cannot cancel a READ still running
  at the deadline, or when its peer is dropped) failed, but its local blocks may still
  be written: the peer's answer lands whenever a frozen peer resumes. The caller must
  keep those blocks out of use (quarantined) until the transfer id comes back, once, in
  ``FetchResults.released`` of a later poll (or the same one): the write has ended. A
  peer frozen for good keeps its late fetches' blocks quarantined for good
  (``num_late_fetches``); ``close`` releases them all (nothing writes after it).
* ``block_hashes`` (32-byte digests from ``common.hashing``) are required by
  ``shared_storage``, which names its files by them; the other transports ignore them.
* ``abort_fetch`` gives a fetch up early where the transport can stop safely; the fetch is
  still reported once, and nothing writes its local blocks after that report.
* ``close`` fails the fetches still running with ``ConnectorClosedError`` and frees every
  resource; the connector is unusable afterwards.

Methods may be called from one engine thread; connectors are internally thread-safe with
respect to their own background threads, not to concurrent callers.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.errors import ConnectorClosedError
from kv_transfer.handshake import (
    HANDSHAKE_VERSION,
    MetadataFetcher,
    PeerMetadata,
    encode_metadata,
)
from kv_transfer.layout import KVCaches, KVLayout
from kv_transfer.records import ExportRecord, FetchRecord, FetchResults, PeerRef
from kv_transfer.tracker import ExportTracker, FetchTracker

BLOCK_HASH_BYTES = 32


class KVConnector(ABC):
    """One transport. Subclasses implement the ``_on_*`` hooks and ``_close``; the public
    methods validate arguments and keep the bookkeeping uniform across transports."""

    name: ClassVar[ConnectorName]

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        fetch_peer_metadata: MetadataFetcher | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self._fetch_peer_metadata = fetch_peer_metadata
        self._fetches = FetchTracker()
        self._exports = ExportTracker()
        self._kv: KVCaches | None = None
        self._closed = False

    # -- setup ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Register the engine's per-layer KV tensors; once, before any transfer."""
        if self._kv is not None:
            raise RuntimeError("KV caches are already registered")
        kv = KVCaches.from_tensors(kv_caches, self.config.tp_size, self.config.tp_rank)
        self._kv = kv  # before the hook: the threads it starts may read it
        try:
            self._on_register(kv)
        except BaseException:
            self._kv = None
            raise

    @property
    def kv(self) -> KVCaches:
        if self._kv is None:
            raise RuntimeError("register_kv_caches first")
        return self._kv

    @property
    def layout(self) -> KVLayout:
        return self.kv.layout

    def metadata(self) -> bytes:
        """The handshake envelope peers fetch through the control channel."""
        return encode_metadata(
            PeerMetadata(
                version=HANDSHAKE_VERSION,
                connector=self.name.value,
                engine_id=self.engine_id,
                layout=self.layout,
                num_blocks=self.kv.num_blocks,
                transport=self._transport_metadata(),
            )
        )

    # -- exporter side ----------------------------------------------------------------

    def export_blocks(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """Offer ``block_ids`` to a peer under ``transfer_id`` (the lease id)."""
        self._check_open()
        self.kv.check_block_ids(block_ids, "export_blocks")
        hashes = _check_hashes(block_hashes, len(block_ids), self._needs_hashes())
        record = ExportRecord(transfer_id, tuple(block_ids), hashes)
        self._exports.add(record)
        self._on_export(record)

    def poll_finished_exports(self) -> list[str]:
        """Transfer ids whose blocks the connector no longer needs; each reported once,
        then forgotten. Never blocks on the network."""
        return self._exports.drain_finished()

    def release_export(self, transfer_id: str) -> None:
        """Forget an export (its lease expired or was aborted); a no-op if unknown.
        Returns once no transport thread reads its blocks any more."""
        self._exports.release(transfer_id)

    # -- fetcher side -----------------------------------------------------------------

    def start_fetch(
        self,
        transfer_id: str,
        peer: PeerRef,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        """Begin pulling ``remote_block_ids`` of ``peer`` into ``local_block_ids``
        (position by position). Returns at once; see ``poll_fetches``."""
        self._check_open()
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(
                f"{len(remote_block_ids)} remote block ids for {len(local_block_ids)} local ones"
            )
        self.kv.check_block_ids(local_block_ids, "start_fetch local")
        if len(set(remote_block_ids)) != len(remote_block_ids):
            raise ValueError("start_fetch remote: block ids repeat")
        hashes = _check_hashes(block_hashes, len(local_block_ids), self._needs_hashes())
        record = FetchRecord(
            transfer_id=transfer_id,
            peer=peer,
            remote_block_ids=tuple(remote_block_ids),
            local_block_ids=tuple(local_block_ids),
            block_hashes=hashes,
            deadline=time.monotonic() + self.config.timeout_s,
        )
        self._fetches.add(record)
        self._on_fetch(record)

    def abort_fetch(self, transfer_id: str) -> None:
        """Give a fetch up (its request was aborted); a no-op if it is not active. Best
        effort, never blocking: a transport stops where it safely can (shared storage no
        longer waits for block files that may never come), and what is being written
        finishes. The fetch is still reported exactly once, as failed with
        ``FetchAbortedError`` (or done, if it finished meanwhile), and its local blocks
        must stay reserved until then, as for any fetch. Transports look at
        ``self._fetches.is_aborted`` where they wait; NIXL and NCCL fetches run to their
        end (milliseconds once the peer answers; their timeout bounds one that does not,
        and a NIXL READ still running then fails late: see the contract above)."""
        self._fetches.abort(transfer_id)

    def poll_fetches(self) -> FetchResults:
        """Fetches settled since the last call (done ids, failed id -> error, which of
        those are late) and late fetches released since. Non-blocking."""
        return self._fetches.drain()

    def wait(self, transfer_id: str, timeout_s: float | None = None) -> None:
        """Block until one fetch settles (for tests and tools); raise its error if it
        failed, ``TimeoutError`` if it is still running after ``timeout_s``."""
        error = self._fetches.wait(transfer_id, timeout_s)
        if error is not None:
            raise error

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def num_active_fetches(self) -> int:
        return len(self._fetches)

    @property
    def num_late_fetches(self) -> int:
        """Fetches reported failed and late whose write has not ended: their local blocks
        are quarantined by the caller until released."""
        return len(self._fetches.late())

    @property
    def num_active_exports(self) -> int:
        return len(self._exports)

    def close(self) -> None:
        """Fail the fetches still running and release the late ones: once ``_close`` has
        stopped the transport, nothing writes any local block."""
        if self._closed:
            return
        self._closed = True
        self._close()
        for record in self._fetches.active():
            self._fetches.fail(record.transfer_id, ConnectorClosedError("connector closed"))
        for transfer_id in self._fetches.late():
            self._fetches.release(transfer_id)

    def __enter__(self) -> KVConnector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} connector is closed")

    # -- transport hooks ----------------------------------------------------------------

    def _needs_hashes(self) -> bool:
        """Whether export/fetch must carry block hashes."""
        return False

    @abstractmethod
    def _on_register(self, kv: KVCaches) -> None:
        """Make the caches reachable (register memory, open sockets, start threads)."""

    @abstractmethod
    def _transport_metadata(self) -> bytes:
        """The transport's own section of the handshake envelope."""

    @abstractmethod
    def _on_export(self, record: ExportRecord) -> None:
        """A new export was recorded; must not block on the network."""

    @abstractmethod
    def _on_fetch(self, record: FetchRecord) -> None:
        """A new fetch was recorded; settle it later through ``self._fetches``."""

    @abstractmethod
    def _close(self) -> None:
        """Stop background threads and free transport resources."""


def _check_hashes(
    block_hashes: Sequence[bytes] | None, num_blocks: int, required: bool
) -> tuple[bytes, ...] | None:
    if block_hashes is None:
        if required:
            raise ValueError("this connector names blocks by hash: block_hashes is required")
        return None
    if len(block_hashes) != num_blocks:
        raise ValueError(f"{len(block_hashes)} block hashes for {num_blocks} blocks")
    for block_hash in block_hashes:
        if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_BYTES:
            raise ValueError(f"a block hash must be {BLOCK_HASH_BYTES} bytes")
    return tuple(block_hashes)
