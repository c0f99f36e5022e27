"""One read lane of the NIXL connector: a NIXL agent and the one thread that owns it.

Why lanes: on DRAM the only zero-copy path UCX has between two processes is ``cma``
(``process_vm_readv``), which copies inside the thread that posts the READ, on one core.
Splitting a fetch over lanes copies on several cores at once (measured on the 2-core CI
host: 6.5 -> 9.8 GB/s for 256 MB of scattered blocks, see
``benchmarks/results/kv_transfer_cpu.md``); the connector may pin each lane's thread to
its own core (``nixl.lane_cpus``). On VRAM the copy engines do the work and one
lane suffices. Each lane is its own agent (its own UCX worker, memory registration and
endpoints), used by its own thread only, so no NIXL call is ever made from two threads.

A lane takes commands in order (peer added, peer dropped, read a part, stop), drives UCX
progress only while its READs are in flight (idle, it sleeps on its queue), and reports
every part it was given exactly once through ``on_done``: DONE, failed, past its
deadline, dropped with its peer, or abandoned at close; a part reported *late* is
reported once more, as ``LateReadEnded``, when its READ has ended. Reports are called on
the lane thread (at close, on the closing one) and must not block.

A part reported failed may still be written to while its READ runs: the engine would hand
a failed fetch's blocks to other requests. UCX cannot cancel a READ.
Releasing a running one's NIXL handle only frees the handle: over TCP the peer's answer,
sent once a frozen peer resumes, still landed in the blocks at the lane's next progress
(``tests/kv_transfer/test_late_reads.py``). Destroying the lane's agent would stop it,
but a peer answering over TCP then aborts (UCX 1.23's software GET reply meets the closed
endpoint: "Fatal: unexpected error", seen with a prototype that replaced such lanes), so
a slow prefill worker would be killed by a decode worker's timeout. So a READ still
running at its deadline, or when its peer is dropped, is *late*: it is reported failed
then, flagged late (``PartOutcome.late``: the fetch fails at once, and the engine
quarantines its blocks), but it stays in flight and polled (every ``_LATE_POLL_S``)
until NIXL says DONE or ERR, and only then is ``LateReadEnded`` reported (the engine
frees the blocks); its peer's remote agent stays loaded until then, since forgetting it
turns the READ's state to ERR while the bytes may still come. A peer frozen for good
keeps its late READs, and their blocks quarantined, for good: counted
(``num_late_reads_running``) and logged. ERR counts as ended: UCX fails a READ when its
endpoint fails, which completes every request on it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from kv_transfer.errors import KVTransferError, TransferFailedError, TransferTimeoutError
from kv_transfer.packing import bind_device

logger = logging.getLogger(__name__)

_BUSY_POLL_S = 50e-6  # between state checks while a READ is in flight
_LATE_POLL_S = 0.01  # between state checks while only late READs are (a frozen peer's)
_LATE_LOG_S = 10.0  # at most one warning per lane this often about new late READs


@dataclass(frozen=True, slots=True)
class ReadPart:
    """A slice of one fetch's descriptors, read by one lane."""

    transfer_id: str
    index: int  # position among the fetch's parts
    peer_id: str
    local_indices: np.ndarray  # [n] int32 descriptor indices (``nixl_protocol``)
    remote_indices: np.ndarray  # [n] int32, position by position
    deadline: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class PartOutcome:
    part: ReadPart
    error: KVTransferError | None
    peer_broken: bool  # a transport error: the connector should forget the peer
    # Failed while its READ still runs: ``LateReadEnded`` follows once it has ended.
    late: bool = False


@dataclass(frozen=True, slots=True)
class LateReadEnded:
    """A part reported late earlier: its READ has ended, no byte of it lands any more."""

    part: ReadPart


PartReport = Callable[[PartOutcome | LateReadEnded], None]


@dataclass(frozen=True, slots=True)
class LanePeer:
    """What a lane needs to read from a peer."""

    agent_metadata: bytes
    # The peer's descriptor table (``nixl_protocol``): per whole block if ``whole_blocks``
    # (both sides block-major), else per (layer, block).
    descs: np.ndarray
    mem_type: str
    whole_blocks: bool


@dataclass(slots=True)
class _Flight:
    part: ReadPart
    handle: object  # nixl_xfer_handle
    late: bool = False  # reported failed while the READ still ran


class NixlLane:
    """A NIXL agent registered over this process's KV caches, and the thread that owns it.

    Public methods only enqueue commands; ``close`` joins the thread, then frees what the
    thread owned."""

    def __init__(
        self,
        name: str,
        agent_config: nixl_agent_config,
        regions: np.ndarray,
        mem_type: str,
        layer_descs: np.ndarray,
        whole_descs: np.ndarray | None,
        on_done: PartReport,
        cpu: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``regions``: the KV memory to register, [R, 3] uint64 (addr, len, device).
        ``layer_descs`` / ``whole_descs``: this process's descriptor tables per (layer,
        block) and per whole block (None unless block-major), ``nixl_protocol.py``.
        ``cpu``: the core the lane thread is pinned to (None: wherever the scheduler puts it).
        ``device``: the KV's, made current in the lane thread, which posts and progresses
        the READs (UCX cuda_ipc uses the thread's current CUDA context; only the
        connector's driver thread bound it, which matters where a process's KV is not on
        cuda:0; unverified on a GPU so far)."""
        self.name = name
        self._device = device
        self._agent = nixl_agent(name, agent_config)
        self._registration = self._agent.register_memory(regions, mem_type)
        self._local_dlists: dict[bool, object] = {}  # whole_blocks -> prepped local list
        try:
            for whole, descs in ((False, layer_descs), (True, whole_descs)):
                if descs is not None:
                    self._local_dlists[whole] = self._agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", descs, mem_type
                    )
        except BaseException:  # no thread yet: undo the registration here
            for dlist in self._local_dlists.values():
                dlist.release()
            self._agent.deregister_memory(self._registration)
            raise
        self._on_done = on_done
        self.num_late_reads = 0  # READs ever late (module docstring); lane thread writes
        self.num_late_reads_running = 0  # late READs not ended yet
        self._late_logged_at = -_LATE_LOG_S
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stop = threading.Event()
        # Owned by the lane thread:
        # peer id -> (agent name, its dlist, whether both use whole-block descriptors)
        self._peers: dict[str, tuple[str, object, bool]] = {}
        self._dropped: dict[str, tuple[str, object, bool]] = {}  # kept for their late READs
        self._inflight: list[_Flight] = []
        self._thread = threading.Thread(target=self._run, name=f"nixl-{name}", daemon=True)
        self._thread.start()
        if cpu is not None:
            try:  # the lane thread only; set here, so it holds before the first READ
                os.sched_setaffinity(self._thread.native_id, {cpu})
            except OSError as exc:
                logger.warning("%s: cannot pin to core %d: %s", name, cpu, exc)

    # -- commands (any thread) -----------------------------------------------------------

    def add_peer(self, peer_id: str, peer: LanePeer) -> None:
        self._commands.put(("add", peer_id, peer))

    def drop_peer(self, peer_id: str) -> None:
        self._commands.put(("drop", peer_id))

    def read(self, part: ReadPart) -> None:
        self._commands.put(("read", part))

    def close(self) -> None:
        """Stop the thread and destroy the agent, then report each part it still had as
        failed (a late one as ended): with the agent's UCX worker gone, none of its READs
        can land any more."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join()
        outcomes: list[PartOutcome | LateReadEnded] = [
            LateReadEnded(f.part) if f.late else _failed(f.part, "connector closed")
            for f in self._inflight
        ]
        while True:  # parts that never started
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "read":
                outcomes.append(_failed(command[1], "connector closed"))
        self._destroy_agent()
        for outcome in outcomes:
            self._report(outcome)

    def _destroy_agent(self) -> None:
        """Free what holds the agent (transfer and descriptor-list handles), then the agent:
        its UCX worker, endpoints and listener go now, not at garbage collection."""
        for flight in self._inflight:
            try:
                flight.handle.release()
            except Exception as exc:
                logger.warning("%s: releasing a READ at close: %s", self.name, exc)
        self._inflight.clear()
        for peer_id in [*self._peers, *self._dropped]:
            self._forget(peer_id)
        for dlist in self._local_dlists.values():
            dlist.release()
        self._local_dlists.clear()
        self._agent.deregister_memory(self._registration)
        del self._agent

    # -- lane thread ---------------------------------------------------------------------

    def _run(self) -> None:
        if self._device is not None:
            bind_device(self._device)
        while not self._stop.is_set():
            try:
                # Idle, a lane sleeps until a command comes (close sends one); with only
                # late READs in flight, it checks them every _LATE_POLL_S.
                self._drain(self._command_wait_s())
                self._progress()
            except Exception:
                logger.exception("%s: lane step failed", self.name)
            if any(not flight.late for flight in self._inflight):
                time.sleep(_BUSY_POLL_S)

    def _command_wait_s(self) -> float | None:
        if any(not flight.late for flight in self._inflight):
            return 0.0
        return _LATE_POLL_S if self._inflight else None

    def _drain(self, block_s: float | None) -> None:
        """Run queued commands; wait up to ``block_s`` for the first (None: for ever)."""
        command = self._next_command(block_s)
        while command is not None and not self._stop.is_set():
            kind = command[0]
            if kind == "read":
                self._post(command[1])
            elif kind == "add":
                self._add(command[1], command[2])
            elif kind == "drop":
                self._drop(command[1])
            command = self._next_command(0.0)
        if command is not None and command[0] == "read":  # the stop came first: close reports it
            self._commands.put(command)

    def _next_command(self, block_s: float | None) -> tuple | None:
        try:
            if block_s == 0.0:
                return self._commands.get_nowait()
            return self._commands.get(timeout=block_s)
        except queue.Empty:
            return None

    def _add(self, peer_id: str, peer: LanePeer) -> None:
        if peer_id in self._peers:
            return
        if peer_id in self._dropped:  # the same engine again: its agent is still loaded
            self._peers[peer_id] = self._dropped.pop(peer_id)
            return
        try:
            agent_name = self._agent.add_remote_agent(peer.agent_metadata)
            dlist = self._agent.prep_xfer_dlist(agent_name, peer.descs, peer.mem_type)
            self._peers[peer_id] = (agent_name, dlist, peer.whole_blocks)
        except Exception as exc:  # its parts fail as "not loaded"; the connector forgets it
            logger.warning("%s: loading peer %s failed: %s", self.name, peer_id, exc)

    def _post(self, part: ReadPart) -> None:
        if part.deadline <= time.monotonic():
            error = TransferTimeoutError("READ not started by the deadline")
            self._report(PartOutcome(part, error, False))
            return
        peer = self._peers.get(part.peer_id)
        if peer is None:
            self._report(_failed(part, f"peer {part.peer_id!r} is not loaded", peer_broken=True))
            return
        try:
            local_dlist = self._local_dlists[peer[2]]
            handle = self._agent.make_prepped_xfer(
                "READ", local_dlist, part.local_indices, peer[1], part.remote_indices
            )
        except Exception as exc:
            self._report(_failed(part, f"preparing the READ failed: {exc}", peer_broken=True))
            return
        flight = _Flight(part, handle)
        self._inflight.append(flight)
        try:
            state = self._agent.transfer(handle)  # on cma, the whole copy happens here
        except Exception as exc:  # (a failed post: UCX failed the endpoint's requests)
            self._end(flight, _failed(part, f"READ from {part.peer_id!r} failed: {exc}", True))
            return
        self._on_state(flight, state)

    def _progress(self) -> None:
        for flight in list(self._inflight):
            try:
                state = self._agent.check_xfer_state(flight.handle)
            except Exception as exc:
                self._end(flight, _failed(flight.part, f"READ failed: {exc}", True))
                continue
            self._on_state(flight, state)

    def _on_state(self, flight: _Flight, state: str) -> None:
        if state == "DONE":
            self._end(flight, PartOutcome(flight.part, None, False))
        elif state != "PROC":
            self._end(flight, _failed(flight.part, f"READ ended in state {state}", True))
        elif not flight.late and flight.part.deadline <= time.monotonic():
            error = TransferTimeoutError("READ still running at the deadline")
            self._make_late(flight, PartOutcome(flight.part, error, False))

    def _end(self, flight: _Flight, outcome: PartOutcome) -> None:
        """The READ has ended: no byte of it can land any more, so its blocks may be
        reused. Release the handle, then report ``outcome`` (a late READ: that it ended,
        its outcome was reported when it became late)."""
        self._inflight.remove(flight)
        try:
            flight.handle.release()
        except Exception as exc:  # (the READ is over: only the handle's memory is lost)
            logger.warning("%s: releasing READ %s: %s", self.name, flight.part.transfer_id, exc)
        report: PartOutcome | LateReadEnded = outcome
        if flight.late:
            self.num_late_reads_running -= 1
            past_s = time.monotonic() - flight.part.deadline
            logger.info("%s: late READ of %s ended %.1f s past its deadline; its blocks "
                        "are released now", self.name, flight.part.transfer_id, past_s)  # fmt: skip
            report = LateReadEnded(flight.part)
        peer_id = flight.part.peer_id
        if peer_id in self._dropped and not any(f.part.peer_id == peer_id for f in self._inflight):
            self._forget(peer_id)
        self._report(report)

    def _make_late(self, flight: _Flight, outcome: PartOutcome) -> None:
        """Report a READ that still runs failed, flagged late; its end is reported later."""
        flight.late = True
        self.num_late_reads += 1
        self.num_late_reads_running += 1
        now = time.monotonic()
        if now - self._late_logged_at >= _LATE_LOG_S:
            self._late_logged_at = now
            logger.warning(
                "%s: READ of %s from %s is late (%s); UCX cannot cancel it, so its fetch "
                "fails now but its blocks stay quarantined until it ends (the peer answers "
                "or its connection fails). %d late READs running, %d so far",
                self.name, flight.part.transfer_id, flight.part.peer_id, outcome.error,
                self.num_late_reads_running, self.num_late_reads,
            )  # fmt: skip
        self._report(dataclasses.replace(outcome, late=True))

    def _drop(self, peer_id: str) -> None:
        """Forget a peer; its READs still running are late. Its remote agent stays loaded
        until they end (see the module docstring)."""
        flights = [f for f in self._inflight if f.part.peer_id == peer_id]
        for flight in flights:
            if not flight.late:
                self._make_late(flight, _failed(flight.part, f"peer {peer_id!r} disconnected"))
        if flights and peer_id in self._peers:
            self._dropped[peer_id] = self._peers.pop(peer_id)
        elif not flights:
            self._forget(peer_id)

    def _forget(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id, None) or self._dropped.pop(peer_id, None)
        if peer is None:
            return
        try:
            peer[1].release()
            self._agent.remove_remote_agent(peer[0])
        except Exception as exc:
            logger.warning("%s: forgetting peer %s: %s", self.name, peer_id, exc)

    def _report(self, outcome: PartOutcome | LateReadEnded) -> None:
        try:
            self._on_done(outcome)
        except Exception:
            logger.exception("%s: reporting a READ outcome failed", self.name)


def _failed(part: ReadPart, message: str, peer_broken: bool = False) -> PartOutcome:
    return PartOutcome(part, TransferFailedError(message), peer_broken)
