"""The KV connector of a tensor-parallel worker: one connector per rank, driven by rank 0.

Each rank's KV cache holds its own KV heads, so each rank has its own connector (its own
NIXL agent, NCCL pair groups or shared-storage files) and moves its own bytes; rank r of a
prefill worker pairs with rank r of a decode worker of the same size (``KVLayout`` carries
``tp_size`` and ``tp_rank``: other pairings are a mismatch, and move nothing).

    rank 0 (worker process)                         rank r (shard process)
    TensorParallelConnector                         ConnectorExtension
      local connector (rank 0's)                      connector of engine "<id>-tp<r>"
      export / fetch / release / abort  ── ordered ─►   the same call
      poll: settled on every rank?      ◄─ replies ──   ExportsFinished / FetchesSettled

Rank 0 reports an export finished, or a fetch done or failed, only once every rank has:
until then some rank may still read or write those blocks. A fetch that failed late on
some rank (its write may still land there) is reported late, and released once every
such rank has released it. Commands travel in the same
ordered stream as the steps (``engine.parallel.messages``), so a release or an abort
reaches a shard before any later step can reuse its blocks, as on rank 0.

Peers find a rank's handshake through the worker's one gRPC endpoint:
``GetTransferMetadata(tp_rank=r)`` answers rank r's metadata (``metadata_by_rank``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from common.internal_auth import InternalAuth
from engine.parallel.shard_client import ShardClient, ShardError
from kv_transfer import (
    ConnectorName,
    KVConnector,
    KVLayout,
    KVTransferConfig,
    KVTransferError,
    PeerRef,
    TransferFailedError,
    create_connector,
)
from kv_transfer.records import FetchResults
from worker.peer_metadata import PeerMetadataClient

# ------------------------------------------------------------------ messages


class Export(msgspec.Struct, tag="kv_export", frozen=True):
    transfer_id: str
    block_ids: list[int]
    block_hashes: list[bytes] | None


class ReleaseExport(msgspec.Struct, tag="kv_release", frozen=True):
    transfer_id: str


class StartFetch(msgspec.Struct, tag="kv_fetch", frozen=True):
    transfer_id: str
    engine_id: str  # the peer's rank-0 engine id (rank r's is "<engine_id>-tp<r>")
    endpoint: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    block_hashes: list[bytes] | None


class AbortFetch(msgspec.Struct, tag="kv_abort", frozen=True):
    transfer_id: str


class ExportsFinished(msgspec.Struct, tag="kv_exports_finished", frozen=True):
    rank: int
    transfer_ids: list[str]


class FetchesSettled(msgspec.Struct, tag="kv_fetches_settled", frozen=True):
    rank: int
    done: list[str]
    failed: dict[str, str]  # transfer id -> "ErrorType: message"
    late: list[str] = []  # of ``failed``: their blocks may still be written on this rank
    released: list[str] = []  # late earlier (or in ``failed`` here): nothing writes now


MESSAGE_TYPES = (Export, ReleaseExport, StartFetch, AbortFetch, ExportsFinished, FetchesSettled)
EXTENSION = "worker.tp_connector:shard_extension"


class ShardConnectorSettings(msgspec.Struct, frozen=True):
    """What a shard needs to build its connector (rank and size come with the launch)."""

    connector: dict[str, Any]  # KVTransferConfig's fields, as rank 0's
    engine_id: str  # rank 0's; rank r's connector is "<engine_id>-tp<r>"


def rank_engine_id(engine_id: str, rank: int) -> str:
    return engine_id if rank == 0 else f"{engine_id}-tp{rank}"


def rank_config(config: KVTransferConfig, rank: int, size: int) -> KVTransferConfig:
    """Rank ``rank``'s connector settings: its place in the group; the ranks above 0
    listen on ports the OS picks (peers learn them from the handshake)."""
    import dataclasses

    ports = {} if rank == 0 else {"port": 0, "store_port": 0}
    return dataclasses.replace(config, tp_size=size, tp_rank=rank, **ports)


def settings_bytes(config: KVTransferConfig, engine_id: str) -> bytes:
    return msgspec.json.encode(ShardConnectorSettings(msgspec.to_builtins(config), engine_id))


# ------------------------------------------------------------------ shard side


def shard_extension(config: bytes, rank: int, size: int) -> ConnectorExtension:
    """``ShardExtension`` factory, named in ``EXTENSION`` (``engine/parallel``)."""
    settings = msgspec.json.decode(config, type=ShardConnectorSettings)
    return ConnectorExtension(settings, rank, size)


class ConnectorExtension:
    """Rank r's connector in its shard process: does what rank 0's connector is told."""

    message_types = MESSAGE_TYPES

    def __init__(self, settings: ShardConnectorSettings, rank: int, size: int) -> None:
        self.rank = rank
        config = rank_config(KVTransferConfig(**settings.connector), rank, size)
        # (The shard process has its worker's environment: the same internal token.)
        self._metadata_client = PeerMetadataClient(config.timeout_s, rank, InternalAuth.from_env())
        self.connector = create_connector(
            config, rank_engine_id(settings.engine_id, rank), self._metadata_client
        )
        self._replies: list[Any] = []

    def start(self, shard: Any) -> bytes:
        self.connector.register_kv_caches(shard.kv_caches)
        return self.connector.metadata()

    def handle(self, message: Any) -> None:
        connector = self.connector
        if isinstance(message, Export):
            try:
                connector.export_blocks(
                    message.transfer_id, message.block_ids, message.block_hashes
                )
            except (ValueError, RuntimeError):  # nothing to keep for it on this rank
                self._replies.append(ExportsFinished(self.rank, [message.transfer_id]))
        elif isinstance(message, ReleaseExport):
            connector.release_export(message.transfer_id)
        elif isinstance(message, StartFetch):
            peer = PeerRef(rank_engine_id(message.engine_id, self.rank), message.endpoint)
            try:
                connector.start_fetch(
                    message.transfer_id, peer, message.remote_block_ids,
                    message.local_block_ids, message.block_hashes,
                )  # fmt: skip
            except (ValueError, RuntimeError) as exc:
                failed = {message.transfer_id: f"{type(exc).__name__}: {exc}"}
                self._replies.append(FetchesSettled(self.rank, [], failed))
        elif isinstance(message, AbortFetch):
            connector.abort_fetch(message.transfer_id)
        else:
            raise TypeError(f"not a connector command: {message!r}")

    def poll(self) -> list[Any]:
        replies, self._replies = self._replies, []
        finished = self.connector.poll_finished_exports()
        if finished:
            replies.append(ExportsFinished(self.rank, finished))
        results = self.connector.poll_fetches()
        if results:
            failed = {t: f"{type(e).__name__}: {e}" for t, e in results.failed.items()}
            replies.append(
                FetchesSettled(
                    self.rank, results.done, failed, sorted(results.late), results.released
                )
            )
        return replies

    @property
    def busy(self) -> bool:
        connector = self.connector
        return bool(
            connector.num_active_fetches
            or connector.num_active_exports
            or connector.num_late_fetches
        )

    def close(self) -> None:
        self.connector.close()
        self._metadata_client.close()


# ------------------------------------------------------------------ rank 0


class _Fetch:
    __slots__ = ("error", "pending", "writing")

    def __init__(self, ranks: set[int]) -> None:
        self.pending = ranks
        self.error: KVTransferError | None = None
        self.writing: set[int] = set()  # ranks that failed it late, not released yet


class TensorParallelConnector:
    """Rank 0's connector and the other ranks', behind the ``KVConnector`` calls the
    worker makes. Built before the engine (its puller needs a connector), then ``attach``ed
    to the engine's shards (``engine.parallel.ShardClient``) once they run. Engine thread
    only, like any connector."""

    def __init__(self, local: KVConnector, size: int) -> None:
        self.local = local
        self.size = size
        self.shards: ShardClient | None = None
        self._shard_metadata: list[bytes] = []
        self._exports: dict[str, set[int]] = {}  # transfer id -> ranks still holding it
        self._fetches: dict[str, _Fetch] = {}
        self._late: dict[str, set[int]] = {}  # settled late: ranks still writing
        self._finished_exports: list[str] = []
        self._settled = FetchResults()

    def attach(self, shards: ShardClient, shard_metadata: Sequence[bytes]) -> None:
        """The engine's shards and their connectors' metadata (rank 1..), once."""
        assert self.shards is None and shards.size == self.size
        self.shards = shards
        self._shard_metadata = list(shard_metadata)

    @property
    def _shards(self) -> ShardClient:
        assert self.shards is not None, "attach the engine's shards first"
        return self.shards

    @property
    def name(self) -> ConnectorName:
        return self.local.name

    @property
    def engine_id(self) -> str:
        return self.local.engine_id

    @property
    def layout(self) -> KVLayout:
        return self.local.layout

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.local.register_kv_caches(kv_caches)

    def metadata(self) -> bytes:
        return self.local.metadata()

    def metadata_by_rank(self) -> list[bytes]:
        return [self.local.metadata(), *self._shard_metadata]

    # -- exporter side

    def export_blocks(
        self, transfer_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes] | None
    ) -> None:
        self.local.export_blocks(transfer_id, block_ids, block_hashes)  # checks the arguments
        hashes = list(block_hashes) if block_hashes is not None else None
        self._shards.send(Export(transfer_id, list(block_ids), hashes))
        self._exports[transfer_id] = set(range(self.size))

    def poll_finished_exports(self) -> list[str]:
        self._drain()
        for transfer_id in self.local.poll_finished_exports():
            self._export_finished(transfer_id, 0)
        finished, self._finished_exports = self._finished_exports, []
        return finished

    def release_export(self, transfer_id: str) -> None:
        """Best effort on the other ranks: a failed group has no connectors to tell."""
        self.local.release_export(transfer_id)
        if self._exports.pop(transfer_id, None) is not None:
            with contextlib.suppress(ShardError):
                self._shards.send(ReleaseExport(transfer_id))

    def _export_finished(self, transfer_id: str, rank: int) -> None:
        ranks = self._exports.get(transfer_id)
        if ranks is None:  # released meanwhile
            return
        ranks.discard(rank)
        if not ranks:
            del self._exports[transfer_id]
            self._finished_exports.append(transfer_id)

    # -- fetcher side

    def start_fetch(
        self,
        transfer_id: str,
        peer: PeerRef,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        self.local.start_fetch(transfer_id, peer, remote_block_ids, local_block_ids, block_hashes)
        hashes = list(block_hashes) if block_hashes is not None else None
        self._shards.send(
            StartFetch(transfer_id, peer.engine_id, peer.endpoint, list(remote_block_ids),
                       list(local_block_ids), hashes)
        )  # fmt: skip
        self._fetches[transfer_id] = _Fetch(set(range(self.size)))

    def abort_fetch(self, transfer_id: str) -> None:
        self.local.abort_fetch(transfer_id)
        if transfer_id in self._fetches:
            with contextlib.suppress(ShardError):  # best effort, as release_export
                self._shards.send(AbortFetch(transfer_id))

    def poll_fetches(self) -> FetchResults:
        """Fetches settled on every rank: done if done on all, else failed with the first
        rank's error (its local blocks are written by no rank any more)."""
        self._drain()
        results = self.local.poll_fetches()
        for transfer_id in results.done:
            self._fetch_settled(transfer_id, 0, None)
        for transfer_id, error in results.failed.items():
            self._fetch_settled(transfer_id, 0, error, transfer_id in results.late)
        for transfer_id in results.released:
            self._fetch_released(transfer_id, 0)
        settled, self._settled = self._settled, FetchResults()
        return settled

    def _fetch_settled(
        self, transfer_id: str, rank: int, error: KVTransferError | None, late: bool = False
    ) -> None:
        fetch = self._fetches.get(transfer_id)
        if fetch is None:
            return
        fetch.pending.discard(rank)
        if late:
            fetch.writing.add(rank)
        if error is not None and fetch.error is None:
            fetch.error = error
        if fetch.pending:
            return
        del self._fetches[transfer_id]
        if fetch.error is None:
            self._settled.done.append(transfer_id)
            return
        self._settled.failed[transfer_id] = fetch.error
        if fetch.writing:
            self._settled.late.add(transfer_id)
            self._late[transfer_id] = fetch.writing

    def _fetch_released(self, transfer_id: str, rank: int) -> None:
        """Rank ``rank`` no longer writes a fetch it failed late; released once no rank
        does (before it settled everywhere, it simply is not late there any more)."""
        fetch = self._fetches.get(transfer_id)
        if fetch is not None:
            fetch.writing.discard(rank)
            return
        writing = self._late.get(transfer_id)
        if writing is None:
            return
        writing.discard(rank)
        if not writing:
            del self._late[transfer_id]
            self._settled.released.append(transfer_id)

    def _drain(self) -> None:
        for reply in self._shards.extension_replies():
            if isinstance(reply, ExportsFinished):
                for transfer_id in reply.transfer_ids:
                    self._export_finished(transfer_id, reply.rank)
            elif isinstance(reply, FetchesSettled):
                for transfer_id in reply.done:
                    self._fetch_settled(transfer_id, reply.rank, None)
                late = set(reply.late)
                for transfer_id, reason in reply.failed.items():
                    error = TransferFailedError(f"tensor-parallel rank {reply.rank}: {reason}")
                    self._fetch_settled(transfer_id, reply.rank, error, transfer_id in late)
                for transfer_id in reply.released:
                    self._fetch_released(transfer_id, reply.rank)

    # -- lifecycle

    @property
    def num_active_fetches(self) -> int:
        return len(self._fetches)

    @property
    def num_late_fetches(self) -> int:
        return len(self._late)

    @property
    def num_active_exports(self) -> int:
        return len(self._exports)

    def close(self) -> None:
        """Rank 0's connector; the others close with their shard processes."""
        self.local.close()
