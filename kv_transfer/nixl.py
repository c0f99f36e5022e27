"""NIXL connector: the fetcher READs the exporter's registered KV memory directly (UCX).

Memory is registered once, at ``register_kv_caches``; each side describes its cache as one
descriptor per block when its caches are block-major (the engine's arrangement), else per
(layer, block) (``nixl_protocol.py``). A fetch is a READ listing whole blocks when both
sides are block-major, else (layer, block) pairs; NIXL merges adjacent descriptors. The
exporter is passive: once the READ is done the fetcher sends it a NIXL notification
("done"; "abort" when it gives up), and the exporter reports the export finished.

Agents. The *primary* agent holds the registration peers read from and receives their
notifications. READs run on *read lanes* (``nixl_lane.py``): each its own agent and
thread, so a large fetch is split over several cores where the copy happens on the CPU
(DRAM; ``nixl_read_lanes``, default one lane per core up to 4, each pinned to its core; one
lane on VRAM).
Notifications leave from a data-less *notifier* agent: with UCX's peer error handling, an
active message on an endpoint makes the next READ on it wait for the remote agent's next
poll (~1-2 ms per fetch when the notification rides on or beside the READ; on its own
endpoint it waits only for that poll, and READs stay one-sided: 1 MiB in 0.2 ms instead of
1.2). Handshake metadata (agent metadata, base addresses, layout) travels in the envelope
that ``fetch_peer_metadata`` returns.

Threads. A driver thread owns the primary and notifier agents: it dispatches fetches
(splitting each into parts for the lanes), loads peers after their handshake, gathers the
lanes' part outcomes, expires fetches still waiting for a handshake, and collects
notifications. Handshakes run on a small pool because ``fetch_peer_metadata`` may block on
gRPC. Public methods only enqueue commands, so the engine thread never waits on the
network. On ``cma`` a READ copies synchronously inside its lane thread, with the GIL
released; that copy is the one thing a deadline cannot interrupt. UCX's own progress
thread spins and halves CPU bandwidth, so each lane drives progress itself, only while its
READs are in flight.

Late READs. UCX cannot cancel a READ, so one still running at its fetch's deadline (a
frozen or very slow peer) fails its fetch at once as timed out but *late*
(``FetchResults.late``): the peer's answer may still land in its blocks, so the engine
quarantines them until the READ ends and the fetch comes back in
``FetchResults.released`` (``nixl_lane.py``, ``tests/kv_transfer/test_late_reads.py``).
``num_late_reads_running`` counts the late READs not ended yet.

On GPUs, UCX 1.23 turns off cuda_ipc reads when it sees no NVLink and falls back to active
messages over TCP; single-GPU or PCIe hosts must run with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from kv_transfer.base import KVConnector
from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.errors import (
    HandshakeError,
    KVTransferError,
    MetadataUnavailableError,
    TransferFailedError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kv_transfer.handshake import MetadataFetcher, decode_transport, fetch_peer_metadata
from kv_transfer.layout import KVCaches
from kv_transfer.nixl_lane import LanePeer, LateReadEnded, NixlLane, PartOutcome, ReadPart
from kv_transfer.nixl_protocol import (
    NixlPayload,
    Notif,
    desc_indices,
    is_block_major,
    layer_block_descs,
    whole_block_descs,
)
from kv_transfer.packing import bind_device
from kv_transfer.records import ExportRecord, FetchRecord, PeerRef

logger = logging.getLogger(__name__)

MAX_AUTO_LANES = 4
_SILENT_PROBES = 3  # an idle peer unanswered this many times in a row is dropped
_PROBE_RETRY_S = 2.0  # between those probes
# Handshakes and idle probes at once: one per peer at most (both are deduplicated), each
# blocking in the peer's metadata RPC for up to timeout_s when the peer froze. With 2
# threads, two frozen prefill workers held back every other peer's handshake past its
# fetch's deadline. Threads start only as calls need them.
MAX_METADATA_CALLS = 64


@dataclass(slots=True)
class _RemotePeer:
    agent_name: str
    endpoint: str  # its control address: where a liveness probe asks for its metadata
    num_blocks: int
    whole_blocks: bool  # both sides block-major: one descriptor per block
    last_used: float  # time.monotonic() of its last fetch, or of its last liveness answer
    probing: bool = False
    silent_probes: int = 0  # probes in a row it did not answer


@dataclass(slots=True)
class _InFlight:
    record: FetchRecord
    peer_id: str
    pending_parts: int
    error: KVTransferError | None = None  # the first part's error
    writing_parts: int = 0  # parts reported late whose READ has not ended


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


def read_lane_count(config: KVTransferConfig, mem_type: str) -> int:
    """``nixl_read_lanes``, or by default one lane per usable core (up to 4) on DRAM,
    where lanes copy on the CPU, and one on VRAM, where the copy engines do."""
    if config.nixl_read_lanes:
        return config.nixl_read_lanes
    if mem_type == "VRAM":
        return 1
    return max(1, min(MAX_AUTO_LANES, len(os.sched_getaffinity(0))))


def lane_cpus(config: KVTransferConfig, num_lanes: int, mem_type: str) -> list[int | None]:
    """The core each read lane is pinned to (None: not pinned). On DRAM with two lanes or
    more, lane i gets the i-th core this process may use, round robin. Why: a fetch wakes
    its lanes together, and the scheduler often queued two on one core while the other
    idled, so the parts were copied one after the other (``benchmarks/nixl_lanes_trace.py``
    on the 2-core CI host, 16 MB in two parts: side by side in 40 of 40 fetches pinned and
    34 unpinned; 28 and 3 right after a parallel torch op). On VRAM the copy engines copy
    and one lane suffices."""
    if not config.nixl_pin_lanes or mem_type == "VRAM" or num_lanes < 2:
        return [None] * num_lanes
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[index % len(cpus)] for index in range(num_lanes)]


def split_parts(
    local: np.ndarray, remote: np.ndarray, num_lanes: int, bytes_per_desc: int, min_bytes: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut a fetch's descriptor lists into at most ``num_lanes`` runs of equal length (every
    descriptor has the same size), none smaller than ``min_bytes`` unless the fetch is."""
    total = len(local) * bytes_per_desc
    num_parts = num_lanes if min_bytes <= 0 else min(num_lanes, total // min_bytes)
    num_parts = max(1, min(num_parts, len(local)))
    bounds = [len(local) * index // num_parts for index in range(num_parts + 1)]
    return [(local[a:b], remote[a:b]) for a, b in itertools.pairwise(bounds)]


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
        self._agent_config = nixl_agent_config(
            enable_prog_thread=config.nixl_progress_thread, backends=list(config.nixl_backends)
        )
        self._agent = nixl_agent(engine_id, self._agent_config)
        self._notifier = nixl_agent(f"{engine_id}/notifier", self._agent_config)
        self._lanes: list[NixlLane] = []
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._driver = threading.Thread(target=self._run, name=f"nixl-{engine_id}", daemon=True)
        self._handshakes = ThreadPoolExecutor(
            MAX_METADATA_CALLS, thread_name_prefix=f"nixl-handshake-{engine_id}"
        )
        # Owned by the driver thread once it runs:
        self._peers: dict[str, _RemotePeer] = {}
        self._waiting: dict[str, list[FetchRecord]] = {}  # peer id -> fetches awaiting handshake
        self._inflight: dict[str, _InFlight] = {}
        self._writing: dict[str, int] = {}  # late fetch id -> its parts' READs still running
        self._next_lane = 0

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
        block_bytes_per_layer = kv.layout.block_bytes_per_layer
        regions = np.array(
            [(addr, size, self._device_id) for addr, size in kv.regions()], dtype=np.uint64
        )
        self._registration = self._agent.register_memory(regions, self._mem_type)
        try:  # leave nothing registered or running behind
            layer_descs = layer_block_descs(
                self._base_addrs,
                kv.num_blocks,
                block_bytes_per_layer,
                kv.block_stride_bytes,
                self._device_id,
            )
            whole_descs = None
            if kv.block_major:
                whole_descs = whole_block_descs(
                    self._base_addrs[0], kv.num_blocks, kv.layout.block_bytes, self._device_id
                )
            # Static after registration; cached so that no other thread touches the agent.
            self._agent_metadata = self._agent.get_agent_metadata()
            num_lanes = read_lane_count(self.config, self._mem_type)
            for index, cpu in enumerate(lane_cpus(self.config, num_lanes, self._mem_type)):
                lane = NixlLane(
                    f"{self.engine_id}/read{index}",
                    self._agent_config,
                    regions,
                    self._mem_type,
                    layer_descs,
                    whole_descs,
                    lambda outcome: self._commands.put(("part", outcome)),
                    cpu,
                    kv.device,
                )
                self._lanes.append(lane)
        except BaseException:
            for lane in self._lanes:
                lane.close()
            self._lanes.clear()
            self._agent.deregister_memory(self._registration)
            raise
        self._driver.start()

    @property
    def num_late_reads(self) -> int:
        """READs ever still running at their deadline (or when their peer was dropped):
        each failed its fetch late, its blocks quarantined until it ended
        (``nixl_lane.py``)."""
        return sum(lane.num_late_reads for lane in self._lanes)

    @property
    def num_late_reads_running(self) -> int:
        """Late READs not ended yet: their fetches' blocks stay quarantined. One that
        never ends (a peer frozen for good) keeps them for good."""
        return sum(lane.num_late_reads_running for lane in self._lanes)

    def _transport_metadata(self) -> bytes:
        return msgspec.msgpack.encode(
            NixlPayload.for_caches(
                self._agent_metadata,
                self._mem_type,
                self._device_id,
                self._base_addrs,
                self.kv.block_stride_bytes,
                self.layout.block_bytes_per_layer,
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
            addrs, stride = payload.layer_addressing(metadata.layout.block_bytes_per_layer)
            if len(addrs) != metadata.layout.num_layers:
                raise HandshakeError("peer metadata lists the wrong number of layers")
            if stride < metadata.layout.block_bytes_per_layer:
                raise HandshakeError("peer metadata has blocks that overlap (block_stride)")
            result: object = (metadata.num_blocks, payload)
        except KVTransferError as exc:
            result = exc
        except Exception as exc:
            result = HandshakeError(f"handshake with {peer.engine_id!r} failed: {exc}")
        self._commands.put(("peer", peer.engine_id, peer.endpoint, result))

    # -- driver thread ------------------------------------------------------------------

    def _run(self) -> None:
        bind_device(self.kv.device)
        next_idle_check = time.monotonic()
        while not self._stop.is_set():
            try:
                self._drain_commands(self.config.poll_interval_s)
                self._expire_waiting()
                self._collect_notifs()
                if time.monotonic() >= next_idle_check:
                    self._probe_idle_peers()
                    next_idle_check = time.monotonic() + min(1.0, self.config.peer_idle_s / 4)
            except Exception:
                logger.exception("NIXL driver step failed")

    def _probe_idle_peers(self) -> None:
        """Ask each peer with nothing in flight and no fetch for ``peer_idle_s`` whether it
        is still there (its metadata, on the handshake pool). A restarted prefill worker
        answers under a new engine id and a gone one not at all: only then is the peer
        dropped, or its remote agent (UCX endpoints) would stay in every lane for good. A
        live one is kept: NIXL's ``remove_remote_agent`` does not close the UCX
        connections, so forgetting live idle peers and handshaking again leaked lanes + 1
        TCP connections in both processes each time (a soak audit)."""
        cutoff = time.monotonic() - self.config.peer_idle_s
        busy = {flight.peer_id for flight in self._inflight.values()}
        for peer_id, peer in self._peers.items():
            if peer.last_used < cutoff and peer_id not in busy and not peer.probing:
                peer.probing = True
                self._handshakes.submit(self._probe, PeerRef(peer_id, peer.endpoint))

    def _probe(self, peer: PeerRef) -> None:
        """Handshake pool: does ``peer.endpoint`` still answer as ``peer.engine_id``?
        True, False (another engine answers there: restarted), or None (no answer: the
        peer may be gone, or the call failed once under load)."""
        answer: bool | None
        try:
            fetch_peer_metadata(
                self._fetch_peer_metadata, peer, connector=self.name, local_layout=self.layout
            )
            answer = True
        except MetadataUnavailableError as exc:
            logger.info("NIXL peer %s did not answer: %s", peer.engine_id, exc)
            answer = None
        except Exception as exc:
            logger.info("NIXL peer %s is gone: %s", peer.engine_id, exc)
            answer = False
        self._commands.put(("probed", peer.engine_id, answer))

    def _on_probed(self, peer_id: str, answer: bool | None) -> None:
        """Drop a peer another engine replaced, or one silent ``_SILENT_PROBES`` times in a
        row (``_PROBE_RETRY_S`` apart): one failed call (a deadline under load) dropped a
        live peer, and dropping a live one leaks its UCX connections
        (``_probe_idle_peers``)."""
        peer = self._peers.get(peer_id)
        if peer is None:
            return
        peer.probing = False
        now = time.monotonic()
        if answer:
            peer.last_used, peer.silent_probes = now, 0
            return
        peer.silent_probes += 1
        if answer is False or peer.silent_probes >= _SILENT_PROBES:
            self._drop_peer(peer_id)
        else:  # asked again in _PROBE_RETRY_S
            peer.last_used = now - self.config.peer_idle_s + _PROBE_RETRY_S

    def _drain_commands(self, block_s: float) -> None:
        try:
            command = self._commands.get(timeout=block_s)
        except queue.Empty:
            return
        while True:
            kind = command[0]
            if kind == "part":
                self._on_part(command[1])
            elif kind == "fetch":
                self._dispatch(command[1])
            elif kind == "peer":
                self._on_handshake_done(command[1], command[2], command[3])
            elif kind == "probed":
                self._on_probed(command[1], command[2])
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

    def _on_handshake_done(self, peer_id: str, endpoint: str, result: object) -> None:
        waiting = self._waiting.pop(peer_id, [])
        if isinstance(result, KVTransferError):
            for record in waiting:
                self._fetches.fail(record.transfer_id, result)
            return
        num_blocks, payload = result
        layout = self.layout
        addrs, stride = payload.layer_addressing(layout.block_bytes_per_layer)
        whole = self.kv.block_major and is_block_major(addrs, stride, layout.block_bytes_per_layer)
        try:
            agent_name = self._notifier.add_remote_agent(payload.agent_metadata)
            if whole:
                descs = whole_block_descs(
                    addrs[0], num_blocks, layout.block_bytes, payload.device_id
                )
            else:
                descs = layer_block_descs(
                    addrs, num_blocks, layout.block_bytes_per_layer, stride, payload.device_id
                )
        except Exception as exc:
            for record in waiting:
                self._fetches.fail(record.transfer_id, HandshakeError(f"loading peer: {exc}"))
            return
        # (the handshake's own endpoint: its fetches may all have expired meanwhile, and an
        # empty one left a restarted peer's old entry and probed "")
        for old_id in [i for i, p in self._peers.items() if p.endpoint == endpoint]:
            logger.info("forgetting NIXL peer %s: %s now answers as %s", old_id, endpoint,
                        peer_id)  # fmt: skip
            self._drop_peer(old_id)  # restarted behind the same address
        lane_peer = LanePeer(payload.agent_metadata, descs, payload.mem_type, whole)
        for lane in self._lanes:
            lane.add_peer(peer_id, lane_peer)
        self._peers[peer_id] = _RemotePeer(
            agent_name, endpoint, num_blocks, whole, time.monotonic()
        )
        for record in waiting:
            self._post(record, peer_id)

    def _post(self, record: FetchRecord, peer_id: str) -> None:
        tid = record.transfer_id
        peer = self._peers.get(peer_id)
        if peer is None:  # dropped by an earlier failure in the same batch
            self._fetches.fail(tid, TransferFailedError(f"peer {peer_id!r} disconnected"))
            return
        peer.last_used = time.monotonic()
        if any(not 0 <= b < peer.num_blocks for b in record.remote_block_ids):
            error = TransferRejectedError(f"remote block id outside [0, {peer.num_blocks})")
            self._fetches.fail(tid, error)
            return
        if not record.remote_block_ids:
            self._notify(peer_id, Notif("done", tid))
            self._fetches.complete(tid)
            return
        layout, whole = self.layout, peer.whole_blocks
        parts = split_parts(
            desc_indices(record.local_block_ids, layout.num_layers, self.kv.num_blocks, whole),
            desc_indices(record.remote_block_ids, layout.num_layers, peer.num_blocks, whole),
            len(self._lanes),
            layout.block_bytes if whole else layout.block_bytes_per_layer,
            self.config.nixl_lane_min_bytes,
        )
        self._inflight[tid] = _InFlight(record, peer_id, len(parts))
        for index, (local, remote) in enumerate(parts):
            lane = self._lanes[self._next_lane]
            self._next_lane = (self._next_lane + 1) % len(self._lanes)
            lane.read(ReadPart(tid, index, peer_id, local, remote, record.deadline))

    def _on_part(self, outcome: PartOutcome | LateReadEnded) -> None:
        """A lane finished a part (or a late part's READ ended); the fetch settles once
        all its parts have, late if any part's READ still runs, and a late fetch is
        released once all of those have ended."""
        if isinstance(outcome, LateReadEnded):
            self._on_late_read_ended(outcome.part.transfer_id)
            return
        tid = outcome.part.transfer_id
        flight = self._inflight.get(tid)
        if flight is None:
            return
        flight.pending_parts -= 1
        flight.writing_parts += outcome.late
        if outcome.error is not None and flight.error is None:
            flight.error = outcome.error
        if outcome.peer_broken:
            self._drop_peer(flight.peer_id)
        if flight.pending_parts:
            return
        del self._inflight[tid]
        # The waiter first, then the exporter: its release is not on the fetch's path.
        if flight.error is None:
            self._fetches.complete(tid)
            # Standalone, not attached to the READ: see the module docstring.
            self._notify(flight.peer_id, Notif("done", tid))
            return
        if flight.writing_parts:
            self._writing[tid] = flight.writing_parts
            self._fetches.fail_late(tid, flight.error)
        else:
            self._fetches.fail(tid, flight.error)
        self._notify(flight.peer_id, Notif("abort", tid))  # if the peer is still known

    def _on_late_read_ended(self, tid: str) -> None:
        flight = self._inflight.get(tid)
        if flight is not None:  # other parts still run: the fetch has not settled yet
            flight.writing_parts -= 1
            return
        left = self._writing.get(tid, 0) - 1
        if left > 0:
            self._writing[tid] = left
        elif self._writing.pop(tid, None) is not None:
            self._fetches.release(tid)

    def _expire_waiting(self) -> None:
        for peer_id, records in self._waiting.items():
            for record in [r for r in records if r.remaining_s() <= 0]:
                records.remove(record)
                error = TransferTimeoutError(f"no handshake with {peer_id!r} before the deadline")
                self._fetches.fail(record.transfer_id, error)

    def _drop_peer(self, peer_id: str) -> None:
        """Forget a peer after a transport error; the next fetch handshakes again. The
        lanes fail its parts still in flight."""
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        for lane in self._lanes:
            lane.drop_peer(peer_id)
        try:
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
        for lane in self._lanes:  # destroys their agents, then fails their parts
            lane.close()
        self._inflight.clear()
        self._writing.clear()  # (released by ``close``: no READ lands after the lanes')
        for peer_id in list(self._peers):
            self._drop_peer(peer_id)
        if self._kv is not None:
            self._agent.deregister_memory(self._registration)
        # Free the agents (and their UCX listeners) now, not whenever the connector is
        # garbage-collected.
        self._lanes.clear()
        del self._agent, self._notifier
