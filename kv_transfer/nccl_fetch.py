"""Fetcher half of the NCCL connector: one thread per exporting peer.

The thread owns everything about that peer: the DEALER socket, the TCPStore client, the
pair's process group and two staging buffers. It runs the peer's fetches one after the
other (one connection per peer, reused), receiving layer group ``g + 1`` while it scatters
group ``g``. Receives land only in the staging buffers; this thread scatters them into
the KV blocks itself, before the fetch settles (on CUDA: queued on the current stream,
ahead of anything later queued there). Any transport error or timeout tears the
connection down (aborting the group, so no pending receive can land later) and fails the
fetch, so nothing writes a failed fetch's blocks afterwards, whenever the exporter sends
(``tests/kv_transfer/test_late_reads.py``); the next fetch reconnects with
a fresh handshake, which also picks up a restarted peer. An exporter that dropped the
pair (idle too long) says so, and the fetch reconnects once, within its deadline. The
connector stops fetchers whose peer has had no fetch for ``idle_s``.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from common.hosts import host_port
from common.zmq_tcp import tcp_socket
from kv_transfer.errors import (
    HandshakeError,
    KVTransferError,
    LayoutMismatchError,
    TransferFailedError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kv_transfer.handshake import decode_transport
from kv_transfer.layout import KVCaches
from kv_transfer.nccl_protocol import (
    Abort,
    Accepted,
    Connect,
    Done,
    FetchRequest,
    NcclPayload,
    Rejected,
    abort_group,
    connect_proof,
    control_message_limit,
    decode_to_fetcher,
    encode,
    open_pair_group,
    tag,
    wait_work,
)
from kv_transfer.packing import (
    bind_device,
    block_id_tensor,
    layer_groups,
    scatter_layers,
    staging_numel,
    staging_view,
)
from kv_transfer.records import FetchRecord
from kv_transfer.tracker import FetchTracker

logger = logging.getLogger(__name__)

PeerLookup = Callable[[FetchRecord], tuple[int, bytes]]
"""Handshake: the peer's (num_blocks, NCCL section), validated; raises KVTransferError."""


@dataclass(frozen=True, slots=True)
class FetchSettings:
    engine_id: str
    host: str
    staging_bytes: int
    timeout_s: float


class _PairDropped(Exception):
    """The exporter no longer knows our pair: nothing was sent; connect again."""


@dataclass(slots=True)
class _Connection:
    pair_id: str
    dealer: zmq.Socket
    store: dist.Store
    group: dist.ProcessGroup
    num_blocks: int
    seq: int = 0


class PeerFetcher(threading.Thread):
    def __init__(
        self,
        peer_id: str,
        kv: KVCaches,
        fetches: FetchTracker,
        lookup: PeerLookup,
        context: zmq.Context,
        settings: FetchSettings,
    ) -> None:
        super().__init__(name=f"nccl-fetch-{peer_id}", daemon=True)
        self._peer_id, self._kv, self._fetches, self._lookup = peer_id, kv, fetches, lookup
        self._context, self._settings = context, settings
        self._jobs: queue.SimpleQueue[FetchRecord | None] = queue.SimpleQueue()
        self._conn: _Connection | None = None
        self._staging: list[torch.Tensor] = []
        self._stopping = threading.Event()
        self.last_used = time.monotonic()  # written by the connector, under its lock

    def submit(self, record: FetchRecord) -> None:
        self._jobs.put(record)

    def stop(self) -> None:
        """Finish the fetch in progress, skip the queued ones (close() fails them), exit."""
        self._stopping.set()
        self._jobs.put(None)

    def run(self) -> None:
        try:
            bind_device(self._kv.device)
            while (record := self._jobs.get()) is not None:
                if not self._stopping.is_set():
                    self._run_one(record)
        finally:
            self._disconnect()

    def _run_one(self, record: FetchRecord) -> None:
        tid = record.transfer_id
        if record.remaining_s() <= 0:  # nothing was sent: the connection stays
            if self._conn is not None:
                self._send(self._conn, Abort(tid))
            error = TransferTimeoutError("deadline passed while queued behind other fetches")
            self._fetches.fail(tid, error)
            return
        try:
            if self._conn is None:
                self._conn = self._connect(record)
            try:
                self._fetch(self._conn, record)
            except _PairDropped:
                self._disconnect()
                self._conn = self._connect(record)
                self._fetch(self._conn, record)
        except _PairDropped:
            self._disconnect()
            self._fetches.fail(tid, TransferFailedError(f"{self._peer_id!r} dropped the pair"))
        except TransferRejectedError as exc:
            self._fetches.fail(tid, exc)  # nothing was sent: the connection is still good
        except HandshakeError as exc:
            self._fail_and_disconnect(record, exc)
            self._fail_queued(exc)
        except KVTransferError as exc:
            self._fail_and_disconnect(record, exc)
        except Exception as exc:
            self._fail_and_disconnect(record, TransferFailedError(f"{type(exc).__name__}: {exc}"))
        else:
            self._fetches.complete(tid)

    def _fail_and_disconnect(self, record: FetchRecord, error: KVTransferError) -> None:
        if self._conn is not None:
            self._send(self._conn, Abort(record.transfer_id))
        self._disconnect()  # before reporting: no receive may land after the failure
        self._fetches.fail(record.transfer_id, error)

    def _fail_queued(self, error: HandshakeError) -> None:
        """The peer failed a handshake (no metadata within the call's timeout, another
        engine at its endpoint, a refused connection): every fetch queued behind this one
        would wait for its own handshake to fail the same way, up to twice its deadline.
        Fail them now, as NIXL fails the fetches that waited on one handshake; fetches
        submitted later try a fresh one."""
        while True:
            try:
                record = self._jobs.get_nowait()
            except queue.Empty:
                return
            if record is None:  # stop(): leave the rest to close()
                self._jobs.put(None)
                return
            queued_error = HandshakeError(f"{error} (for the fetch before this one)")
            self._fetches.fail(record.transfer_id, queued_error)

    # -- connection -------------------------------------------------------------------

    def _connect(self, record: FetchRecord) -> _Connection:
        num_blocks, section = self._lookup(record)
        payload = decode_transport(section, NcclPayload)
        dealer = tcp_socket(self._context, zmq.DEALER, payload.host)
        dealer.setsockopt(zmq.MAXMSGSIZE, control_message_limit(0))  # (replies: no block ids)
        dealer.connect(f"tcp://{host_port(payload.host, payload.control_port)}")
        pair_id = uuid.uuid4().hex
        try:
            proof = connect_proof(payload.pair_key, pair_id)
            dealer.send(encode(Connect(pair_id, self._settings.engine_id, self._kv.layout, proof)))
            reply = self._await_reply(dealer, pair_id, record)
            if isinstance(reply, Rejected):
                if reply.layout_mismatch:
                    raise LayoutMismatchError({"layout": (self._kv.layout, reply.reason)})
                raise HandshakeError(f"peer refused the connection: {reply.reason}")
            remaining_s = max(record.remaining_s(), 1e-3)
            timeout = datetime.timedelta(seconds=remaining_s)
            store = dist.TCPStore(payload.host, payload.store_port, None, False, timeout)
            # Gloo rendezvouses now: bound it by this fetch's deadline. NCCL connects lazily
            # and its watchdog uses the group timeout for every later op: give it the full one.
            group_timeout_s = remaining_s if payload.backend == "gloo" else self._settings.timeout_s
            group = open_pair_group(
                store, pair_id, 1, payload.backend, self._settings.host, group_timeout_s
            )
        except BaseException:
            dealer.close(linger=0)
            raise
        return _Connection(pair_id, dealer, store, group, num_blocks)

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            abort_group(conn.group)
            conn.dealer.close(linger=0)
        self._staging = []  # a receive of the aborted group may still point at them

    def _send(self, conn: _Connection, message: Done | Abort | FetchRequest) -> None:
        try:
            conn.dealer.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("control message to %s dropped: %s", self._peer_id, exc)

    def _await_reply(
        self, dealer: zmq.Socket, request_id: str, record: FetchRecord
    ) -> Accepted | Rejected:
        while (remaining := record.remaining_s()) > 0:
            if not dealer.poll(max(1, int(remaining * 1000))):
                continue
            try:
                reply = decode_to_fetcher(dealer.recv())
            except Exception as exc:
                raise TransferFailedError(f"malformed reply from {self._peer_id}: {exc}") from exc
            if reply.request_id == request_id:
                return reply
        raise TransferTimeoutError(f"no reply from {self._peer_id!r} before the deadline")

    # -- one fetch ----------------------------------------------------------------------

    def _fetch(self, conn: _Connection, record: FetchRecord) -> None:
        num_blocks = len(record.local_block_ids)
        if any(not 0 <= b < conn.num_blocks for b in record.remote_block_ids):
            raise TransferRejectedError(f"remote block id outside [0, {conn.num_blocks})")
        groups = layer_groups(self._kv.layout, num_blocks, self._settings.staging_bytes)
        conn.seq += 1
        request = FetchRequest(
            pair_id=conn.pair_id,
            transfer_id=record.transfer_id,
            block_ids=list(record.remote_block_ids),
            layers_per_group=len(groups[0]),
            seq=conn.seq,
        )
        self._send(conn, request)
        reply = self._await_reply(conn.dealer, record.transfer_id, record)
        if isinstance(reply, Rejected):
            if reply.unknown_pair:
                raise _PairDropped(reply.reason)
            raise TransferRejectedError(reply.reason)
        if num_blocks:
            self._receive(conn, record, groups)
        self._send(conn, Done(record.transfer_id))

    def _receive(self, conn: _Connection, record: FetchRecord, groups: list[range]) -> None:
        kv, layout = self._kv, self._kv.layout
        num_blocks = len(record.local_block_ids)
        numel = staging_numel(layout, len(groups[0]), num_blocks)
        if not self._staging or self._staging[0].numel() < numel:
            self._staging = [
                torch.empty(numel, dtype=layout.torch_dtype, device=kv.device) for _ in range(2)
            ]
        ids = block_id_tensor(record.local_block_ids, kv.device)
        views = [
            staging_view(self._staging[i % 2], layout, len(layers), num_blocks)
            for i, layers in enumerate(groups)
        ]
        pending = [conn.group.recv([views[0]], 0, tag(conn.seq, 0, len(groups)))]
        try:
            for i, layers in enumerate(groups):
                if i + 1 < len(groups):
                    next_tag = tag(conn.seq, i + 1, len(groups))
                    pending.append(conn.group.recv([views[i + 1]], 0, next_tag))
                wait_work(pending[i], record.deadline, kv.device)
                scatter_layers(views[i], kv, layers, ids)
        finally:
            # Failed partway too: the groups scattered so far are queued on this thread's
            # stream, and the fetch's blocks go back to the engine once it is reported.
            if kv.device.type == "cuda":
                torch.cuda.current_stream(kv.device).synchronize()
