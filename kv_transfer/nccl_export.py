"""Exporter half of the NCCL connector: a control thread and one sender thread per pair.

The control thread owns the ZMQ ROUTER socket: it answers ``Connect`` (start a pair's
sender) and ``FetchRequest`` (check the export, queue the send) and turns ``Done`` /
``Abort`` into finished exports. Replies come only from this thread, so no socket is
shared. A pair's sender gathers each layer group into one of two staging buffers and
sends it while gathering the next. A failed pair is aborted and forgotten; the fetcher
reconnects with a new pair id, so one broken peer never blocks another. A pair is also
dropped when its fetcher connects again (it tore the old connection down) and after
``idle_s`` without a fetch (its decode worker may be gone for good: a restarted one comes
back under a new engine id); each held a thread and two staging buffers, and counted
toward ``MAX_PAIRS``.

Each pair rendezvouses through its own TCPStore client. A store object runs one operation
at a time: on the shared server object, a pair whose fetcher died between ``Connect`` and
the rendezvous held every other pair's rendezvous for ``timeout_s`` (CI saw a healthy
fetch time out behind a killed one).
"""

from __future__ import annotations

import datetime
import hmac
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from kv_transfer.layout import KVCaches
from kv_transfer.nccl_protocol import (
    Abort,
    Accepted,
    Connect,
    Done,
    FetchRequest,
    Rejected,
    abort_group,
    connect_proof,
    decode_to_exporter,
    encode,
    open_pair_group,
    tag,
    wait_work,
)
from kv_transfer.packing import (
    bind_device,
    block_id_tensor,
    gather_layers,
    groups_of,
    staging_numel,
    staging_view,
)
from kv_transfer.tracker import ExportTracker

logger = logging.getLogger(__name__)

_POLL_MS = 50  # control loop wake-up, bounds the close() latency
# Fetcher processes connected at once. One per decode worker in practice; the bound keeps a
# misbehaving peer from starting sender threads without end.
MAX_PAIRS = 256
# Malformed control messages are said at most this often (with how many were not): one
# line each let an unauthenticated peer write 75 MiB of log with five messages.
_MALFORMED_LOG_S = 60.0


@dataclass(frozen=True, slots=True)
class ExportSettings:
    host: str
    store_port: int  # the exporter's TCPStore server, on ``host``
    backend: str
    timeout_s: float
    idle_s: float  # a pair without a fetch this long is dropped
    pair_key: bytes  # a Connect's proof is keyed by it (``nccl_protocol.py``)


class PairSender(threading.Thread):
    """Sends the transfers of one fetcher, in order, over the pair's process group."""

    def __init__(
        self,
        pair_id: str,
        fetcher_id: str,
        kv: KVCaches,
        exports: ExportTracker,
        settings: ExportSettings,
    ) -> None:
        super().__init__(name=f"nccl-send-{pair_id[:8]}", daemon=True)
        self.pair_id = pair_id
        self.fetcher_id = fetcher_id  # the fetcher's engine id
        self.last_used = time.monotonic()  # written by the control thread
        self._kv, self._exports, self._settings = kv, exports, settings
        self._jobs: queue.SimpleQueue[FetchRequest | None] = queue.SimpleQueue()
        self._group: dist.ProcessGroup | None = None
        self._staging: list[torch.Tensor] = []
        self.failed = False

    def submit(self, request: FetchRequest | None) -> None:
        """Queue a send; None stops the thread."""
        self._jobs.put(request)

    def run(self) -> None:
        settings = self._settings
        try:
            bind_device(self._kv.device)
            timeout = datetime.timedelta(seconds=settings.timeout_s)
            store = dist.TCPStore(settings.host, settings.store_port, None, False, timeout)
            self._group = open_pair_group(
                store, self.pair_id, 0, settings.backend, settings.host, settings.timeout_s
            )
            while (request := self._jobs.get()) is not None:
                self._send(request)
        except Exception as exc:
            logger.warning("pair %s failed, dropping it: %s", self.pair_id, exc)
        finally:
            self.failed = True
            abort_group(self._group)

    def _buffers(self, numel: int) -> list[torch.Tensor]:
        if not self._staging or self._staging[0].numel() < numel:
            kv = self._kv
            self._staging = [
                torch.empty(numel, dtype=kv.layout.torch_dtype, device=kv.device) for _ in range(2)
            ]
        return self._staging

    def _send(self, request: FetchRequest) -> None:
        kv, layout = self._kv, self._kv.layout
        num_blocks = len(request.block_ids)
        if num_blocks == 0:
            return
        groups = groups_of(layout.num_layers, request.layers_per_group)
        buffers = self._buffers(staging_numel(layout, len(groups[0]), num_blocks))
        ids = block_id_tensor(request.block_ids, kv.device)
        deadline = time.monotonic() + self._settings.timeout_s
        pending: list[dist.Work | None] = [None, None]
        for i, layers in enumerate(groups):
            slot = i % 2
            if pending[slot] is not None:
                wait_work(pending[slot], deadline, kv.device)
            staging = staging_view(buffers[slot], layout, len(layers), num_blocks)
            with self._exports.reading(request.transfer_id) as export:
                if export is None:
                    raise RuntimeError(f"export {request.transfer_id} released mid-transfer")
                gather_layers(kv, layers, ids, out=staging)
            assert self._group is not None
            pending[slot] = self._group.send([staging], 1, tag(request.seq, i, len(groups)))
        for work in pending:
            if work is not None:
                wait_work(work, deadline, kv.device)


class ExportServer(threading.Thread):
    """The exporter's control loop: owns the ROUTER socket and the pair senders."""

    def __init__(
        self,
        router: zmq.Socket,
        kv: KVCaches,
        exports: ExportTracker,
        settings: ExportSettings,
    ) -> None:
        super().__init__(name="nccl-export-control", daemon=True)
        self._router, self._kv = router, kv
        self._exports, self._settings = exports, settings
        self._pairs: dict[str, PairSender] = {}
        self._stopping = threading.Event()
        self._num_malformed = 0
        self._malformed_logged_at = -_MALFORMED_LOG_S

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._router.poll(_POLL_MS):
                    frames = self._router.recv_multipart()
                    try:  # one bad message, or one failed reply, must not end the loop
                        if len(frames) != 2:
                            self._malformed(f"{len(frames) - 1} payload frames, expected 1")
                        else:
                            self._handle(frames[0], frames[1])
                    except Exception:
                        logger.exception("dropping a control message")
                self._reap()
        finally:
            for pair in self._pairs.values():
                pair.submit(None)
            self._router.close(linger=0)

    def _handle(self, identity: bytes, payload: bytes) -> None:
        try:
            message = decode_to_exporter(payload)
        except Exception as exc:
            self._malformed(str(exc)[:200])
            return
        if isinstance(message, Connect):
            reply = self._connect(message)
        elif isinstance(message, FetchRequest):
            reply = self._fetch(message)
        else:
            assert isinstance(message, Done | Abort)
            if isinstance(message, Abort) and self._exports.get(message.transfer_id):
                logger.info("peer aborted transfer %s", message.transfer_id)
            self._exports.finish(message.transfer_id)
            return
        self._router.send_multipart([identity, encode(reply)])

    def _malformed(self, why: str) -> None:
        """A control message that is none of ours: said once a minute at most."""
        self._num_malformed += 1
        now = time.monotonic()
        if now - self._malformed_logged_at >= _MALFORMED_LOG_S:
            logger.warning("ignoring malformed control messages (%d since the last said): %s",
                           self._num_malformed, why)  # fmt: skip
            self._num_malformed, self._malformed_logged_at = 0, now

    def _connect(self, message: Connect) -> Accepted | Rejected:
        expected = connect_proof(self._settings.pair_key, message.pair_id)
        if not message.proof:  # (nothing of ours in either reply)
            reason = "not authorized: the Connect carries no proof (a fetcher older than "
            return Rejected(message.pair_id, reason + "this exporter? upgrade it)")
        if not hmac.compare_digest(message.proof, expected):
            return Rejected(message.pair_id, "not authorized: the Connect's proof is wrong")
        if message.layout != self._kv.layout:
            reason = f"layout mismatch: ours {self._kv.layout}, theirs {message.layout}"
            return Rejected(message.pair_id, reason, layout_mismatch=True)
        # A fetcher keeps one connection to us: connecting again, it gave the old one up.
        for pair_id, old in list(self._pairs.items()):
            if pair_id == message.pair_id or old.fetcher_id == message.engine_id:
                self._drop(pair_id)
        if len(self._pairs) >= MAX_PAIRS:
            return Rejected(message.pair_id, f"too many fetchers connected ({MAX_PAIRS})")
        pair = PairSender(
            message.pair_id, message.engine_id, self._kv, self._exports, self._settings
        )
        self._pairs[message.pair_id] = pair
        pair.start()
        return Accepted(message.pair_id)

    def _fetch(self, message: FetchRequest) -> Accepted | Rejected:
        pair = self._pairs.get(message.pair_id)
        if pair is None or pair.failed:
            reason = "unknown or failed pair; reconnect"
            return Rejected(message.transfer_id, reason, unknown_pair=True)
        pair.last_used = time.monotonic()
        export = self._exports.get(message.transfer_id)
        if export is None:
            return Rejected(message.transfer_id, "no such export (unknown or released lease)")
        requested = set(message.block_ids)
        if len(requested) != len(message.block_ids) or not requested <= set(export.block_ids):
            return Rejected(message.transfer_id, "asked for repeated blocks or ones outside it")
        if not 1 <= message.layers_per_group <= self._kv.layout.num_layers:
            return Rejected(message.transfer_id, "bad layers_per_group")
        pair.submit(message)
        return Accepted(message.transfer_id)

    def _reap(self) -> None:
        """Forget failed pairs; stop the idle ones. On this thread, so that no fetch can be
        handed to a pair between its last check and its stop."""
        cutoff = time.monotonic() - self._settings.idle_s
        for pair_id, pair in list(self._pairs.items()):
            if not pair.is_alive():
                del self._pairs[pair_id]
            elif pair.last_used < cutoff:
                logger.info("dropping NCCL pair %s of %s: idle", pair_id, pair.fetcher_id)
                self._drop(pair_id)

    def _drop(self, pair_id: str) -> None:
        pair = self._pairs.pop(pair_id)
        pair.submit(None)  # it finishes the send in progress, then stops
