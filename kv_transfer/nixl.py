"""NIXL connector: the fetcher READs the exporter's registered KV memory directly (UCX).

Memory is registered once, at ``register_kv_caches``; each side describes its cache as one
descriptor per (layer, block) (``nixl_protocol.py``), so a fetch is one READ request listing
the (layer, block) pairs, which NIXL merges where blocks are adjacent. The exporter is
passive: once the READ is done the fetcher sends it a NIXL notification ("done"; "abort"
when it gives up), and the exporter reports the export finished.

Notifications leave from a second, data-less agent (the *notifier*). With UCX's peer error
handling, an active message on an endpoint makes the next READ on it wait for the remote
agent to make progress, i.e. for the exporter's next poll: ~1-2 ms per fetch when the
notification rides on (or beside) the READ. On its own endpoint a notification only waits
for that poll itself, and READs stay one-sided (measured: 1 MiB in 0.2 ms instead of 1.2).
Handshake metadata (agent metadata, base addresses, layout) travels in the envelope that
``fetch_peer_metadata`` returns.

Threads. The NIXL agent is owned by one driver thread: it posts READs, polls their state
(driving UCX progress only while transfers are in flight; UCX's own progress thread spins
and halves CPU bandwidth), expires overdue fetches, and collects notifications. Handshakes
run on a small pool because ``fetch_peer_metadata`` may block on gRPC. Public methods only
enqueue commands, so the engine thread never waits on the network. On shared-memory
transports (UCX ``cma``) a READ copies synchronously inside the driver thread, with the GIL
released; that copy is the one thing a deadline cannot interrupt.

On GPUs, UCX 1.23 turns off cuda_ipc reads when it sees no NVLink and falls back to active
messages over TCP; single-GPU or PCIe hosts must run with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
from nixl._api import nixl_agent, nixl_agent_config

from kv_transfer.base import KVConnector
from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.errors import (
    HandshakeError,
    KVTransferError,
    TransferFailedError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kv_transfer.handshake import MetadataFetcher, decode_transport, fetch_peer_metadata
from kv_transfer.layout import KVCaches
from kv_transfer.nixl_protocol import NixlPayload, Notif, block_descs, desc_indices
from kv_transfer.packing import bind_device
from kv_transfer.records import ExportRecord, FetchRecord, PeerRef

logger = logging.getLogger(__name__)

_BUSY_POLL_S = 50e-6  # between state checks while a READ is in flight


@dataclass(slots=True)
class _RemotePeer:
    agent_name: str
    dlist: object  # nixl_prepped_dlist_handle over the peer's (layer, block) descriptors
    num_blocks: int


@dataclass(slots=True)
class _InFlight:
    record: FetchRecord
    peer_id: str
    handle: object  # nixl_xfer_handle
    outcome: KVTransferError | None = None  # set once settled but not yet released
    settled: bool = False


def _restrict_ucx_net_devices(config: KVTransferConfig) -> None:
    """Keep UCX's listeners off the network when the connector's host is loopback.

    UCX opens a TCP listener on every network device and reads its device list only from
    the environment, so this sets ``UCX_NET_DEVICES`` (unless already set) before the first
    agent of the process exists. It filters network devices only: shared-memory and CUDA
    transports are unaffected.
    """
    devices = config.nixl_net_devices
    if devices is None:
        try:
            loopback = ipaddress.ip_address(config.host).is_loopback
        except ValueError:
            loopback = config.host == "localhost"
        devices = "lo" if loopback else None
    if devices is not None:
        os.environ.setdefault("UCX_NET_DEVICES", devices)


class NixlConnector(KVConnector):
    name = ConnectorName.NIXL

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        fetch_peer_metadata: MetadataFetcher | None = None,
    ) -> None:
        super().__init__(config, engine_id, fetch_peer_metadata)
        _restrict_ucx_net_devices(config)
        agent_config = nixl_agent_config(
            enable_prog_thread=config.nixl_progress_thread, backends=list(config.nixl_backends)
        )
        self._agent = nixl_agent(engine_id, agent_config)
        self._notifier = nixl_agent(f"{engine_id}/notifier", agent_config)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._driver = threading.Thread(target=self._run, name=f"nixl-{engine_id}", daemon=True)
        self._handshakes = ThreadPoolExecutor(2, thread_name_prefix=f"nixl-handshake-{engine_id}")
        # Owned by the driver thread once it runs:
        self._peers: dict[str, _RemotePeer] = {}
        self._waiting: dict[str, list[FetchRecord]] = {}  # peer id -> fetches awaiting handshake
        self._inflight: dict[str, _InFlight] = {}

    # -- setup (engine thread, before the driver starts) ---------------------------------

    def _on_register(self, kv: KVCaches) -> None:
        if kv.device.type == "cuda" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ:
            logger.info(
                "NIXL on VRAM: without NVLink, UCX reads over TCP (~0.5 GB/s) unless "
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y is set (benchmarks/results/kv_transfer_h100.md)"
            )
        self._mem_type = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self._device_id = kv.device.index or 0
        self._base_addrs = [tensor.data_ptr() for tensor in kv.tensors]
        self._registration = self._agent.register_memory(list(kv.tensors))
        descs = block_descs(
            self._base_addrs, kv.num_blocks, kv.layout.block_bytes_per_layer, self._device_id
        )
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self._mem_type)
        # Static after registration; cached so that no other thread touches the agent.
        self._agent_metadata = self._agent.get_agent_metadata()
        self._driver.start()

    def _transport_metadata(self) -> bytes:
        return msgspec.msgpack.encode(
            NixlPayload(
                agent_metadata=self._agent_metadata,
                mem_type=self._mem_type,
                device_id=self._device_id,
                base_addrs=self._base_addrs,
            )
        )

    def _on_export(self, record: ExportRecord) -> None:
        pass  # the memory is registered; the fetcher reads it and notifies us

    def _on_fetch(self, record: FetchRecord) -> None:
        self._commands.put(("fetch", record))

    # -- handshake (pool threads) -------------------------------------------------------

    def _handshake(self, peer: PeerRef) -> None:
        try:
            metadata = fetch_peer_metadata(
                self._fetch_peer_metadata, peer, connector=self.name, local_layout=self.layout
            )
            payload = decode_transport(metadata.transport, NixlPayload)
            if len(payload.base_addrs) != metadata.layout.num_layers:
                raise HandshakeError("peer metadata lists the wrong number of layers")
            result: object = (metadata.num_blocks, payload)
        except KVTransferError as exc:
            result = exc
        except Exception as exc:
            result = HandshakeError(f"handshake with {peer.engine_id!r} failed: {exc}")
        self._commands.put(("peer", peer.engine_id, result))

    # -- driver thread ------------------------------------------------------------------

    def _run(self) -> None:
        bind_device(self.kv.device)
        while not self._stop.is_set():
            try:
                self._drain_commands(0.0 if self._inflight else self.config.poll_interval_s)
                self._progress()
                self._expire_waiting()
                self._collect_notifs()
            except Exception:
                logger.exception("NIXL driver step failed")
            if self._inflight:
                time.sleep(_BUSY_POLL_S)

    def _drain_commands(self, block_s: float) -> None:
        try:
            command = (
                self._commands.get(timeout=block_s) if block_s else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            if command[0] == "fetch":
                self._dispatch(command[1])
            else:
                self._on_handshake_done(command[1], command[2])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, record: FetchRecord) -> None:
        peer_id = record.peer.engine_id
        if peer_id in self._peers:
            self._post(record, peer_id)
        elif peer_id in self._waiting:
            self._waiting[peer_id].append(record)
        else:
            self._waiting[peer_id] = [record]
            self._handshakes.submit(self._handshake, record.peer)

    def _on_handshake_done(self, peer_id: str, result: object) -> None:
        waiting = self._waiting.pop(peer_id, [])
        if isinstance(result, KVTransferError):
            for record in waiting:
                self._fetches.fail(record.transfer_id, result)
            return
        num_blocks, payload = result
        try:
            agent_name = self._agent.add_remote_agent(payload.agent_metadata)
            self._notifier.add_remote_agent(payload.agent_metadata)
            descs = block_descs(
                payload.base_addrs, num_blocks, self.layout.block_bytes_per_layer, payload.device_id
            )
            dlist = self._agent.prep_xfer_dlist(agent_name, descs, payload.mem_type)
        except Exception as exc:
            for record in waiting:
                self._fetches.fail(record.transfer_id, HandshakeError(f"loading peer: {exc}"))
            return
        self._peers[peer_id] = _RemotePeer(agent_name, dlist, num_blocks)
        for record in waiting:
            self._post(record, peer_id)

    def _post(self, record: FetchRecord, peer_id: str) -> None:
        tid = record.transfer_id
        peer = self._peers.get(peer_id)
        if peer is None:  # dropped by an earlier failure in the same batch
            self._fetches.fail(tid, TransferFailedError(f"peer {peer_id!r} disconnected"))
            return
        if any(not 0 <= b < peer.num_blocks for b in record.remote_block_ids):
            error = TransferRejectedError(f"remote block id outside [0, {peer.num_blocks})")
            self._fetches.fail(tid, error)
            return
        try:
            if not record.remote_block_ids:
                self._notify(peer_id, Notif("done", tid))
                self._fetches.complete(tid)
                return
            num_layers = self.layout.num_layers
            local = desc_indices(record.local_block_ids, num_layers, self.kv.num_blocks)
            remote = desc_indices(record.remote_block_ids, num_layers, peer.num_blocks)
            handle = self._agent.make_prepped_xfer(
                "READ", self._local_dlist, local, peer.dlist, remote
            )
        except Exception as exc:
            self._fetches.fail(tid, TransferFailedError(f"preparing the READ failed: {exc}"))
            self._drop_peer(peer_id)
            return
        flight = _InFlight(record, peer_id, handle)
        self._inflight[tid] = flight
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._settle(flight, TransferFailedError(f"READ from {peer_id!r} failed: {exc}"))
            self._drop_peer(peer_id)
            return
        self._on_state(flight, state)

    def _progress(self) -> None:
        for flight in list(self._inflight.values()):
            if flight.record.transfer_id not in self._inflight:
                continue  # settled meanwhile, by a peer dropped earlier in this loop
            if flight.settled:
                self._settle(flight, flight.outcome)  # retry releasing the handle
                continue
            try:
                state = self._agent.check_xfer_state(flight.handle)
            except Exception as exc:
                self._settle(flight, TransferFailedError(f"READ failed: {exc}"))
                self._drop_peer(flight.peer_id)
                continue
            self._on_state(flight, state)

    def _on_state(self, flight: _InFlight, state: str) -> None:
        if state == "DONE":
            self._settle(flight, None)
        elif state != "PROC":
            self._settle(flight, TransferFailedError(f"READ ended in state {state}"))
            self._drop_peer(flight.peer_id)
        elif flight.record.remaining_s() <= 0:
            self._settle(flight, TransferTimeoutError("READ still running at the deadline"))
            self._notify(flight.peer_id, Notif("abort", flight.record.transfer_id))

    def _settle(self, flight: _InFlight, outcome: KVTransferError | None) -> None:
        """Report the outcome once the handle is released (a running READ is cancelled
        by the release); until then the local blocks may still change, so keep trying."""
        flight.settled, flight.outcome = True, outcome
        try:
            flight.handle.release()
        except Exception as exc:
            logger.warning("cannot release READ %s yet: %s", flight.record.transfer_id, exc)
            return
        tid = flight.record.transfer_id
        self._inflight.pop(tid, None)
        if outcome is None:
            # Standalone, not attached to the READ: see the module docstring.
            self._notify(flight.peer_id, Notif("done", tid))
            self._fetches.complete(tid)
        else:
            self._fetches.fail(tid, outcome)

    def _expire_waiting(self) -> None:
        for peer_id, records in self._waiting.items():
            for record in [r for r in records if r.remaining_s() <= 0]:
                records.remove(record)
                error = TransferTimeoutError(f"no handshake with {peer_id!r} before the deadline")
                self._fetches.fail(record.transfer_id, error)

    def _drop_peer(self, peer_id: str) -> None:
        """Forget a peer after a transport error; the next fetch handshakes again."""
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        for flight in [f for f in self._inflight.values() if f.peer_id == peer_id]:
            if not flight.settled:
                self._settle(flight, TransferFailedError(f"peer {peer_id!r} disconnected"))
        try:
            peer.dlist.release()
            self._agent.remove_remote_agent(peer.agent_name)
            self._notifier.remove_remote_agent(peer.agent_name)
        except Exception as exc:
            logger.warning("forgetting NIXL peer %s: %s", peer_id, exc)

    def _notify(self, peer_id: str, notif: Notif) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:
            return
        try:
            self._notifier.send_notif(peer.agent_name, msgspec.msgpack.encode(notif))
        except Exception as exc:
            logger.warning("notifying %s of %s failed: %s", peer_id, notif, exc)

    def _collect_notifs(self) -> None:
        self._notifier.get_new_notifs()  # progresses the notifications we send
        for agent_name, messages in self._agent.get_new_notifs().items():
            for message in messages:
                try:
                    notif = msgspec.msgpack.decode(message, type=Notif)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    logger.warning("ignoring a malformed notification from %s", agent_name)
                    continue
                if not self._exports.finish(notif.transfer_id):
                    logger.debug("%s for unknown export %s", notif.kind, notif.transfer_id)

    # -- shutdown -----------------------------------------------------------------------

    def _close(self) -> None:
        self._stop.set()
        if self._driver.is_alive():
            self._driver.join()
        self._handshakes.shutdown(wait=False, cancel_futures=True)
        for flight in list(self._inflight.values()):
            try:
                flight.handle.release()
            except Exception as exc:
                logger.warning("releasing READ %s at close: %s", flight.record.transfer_id, exc)
        self._inflight.clear()
        for peer_id in list(self._peers):
            self._drop_peer(peer_id)
        if self._kv is not None:
            self._local_dlist.release()
            self._agent.deregister_memory(self._registration)
