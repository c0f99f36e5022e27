"""``fetch_peer_metadata(endpoint)`` for connectors: GetTransferMetadata over gRPC; and
``release_lease``: a decode worker's ReleaseKV for a lease it will never pull."""

from __future__ import annotations

import threading
from collections import OrderedDict

import grpc

from common.internal_auth import NO_AUTH, InternalAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


class PeerMetadataClient:
    """Asks a peer worker for the handshake metadata of its connector of rank ``tp_rank``
    (the same rank as ours: rank r pairs with rank r). Called from connector threads;
    channels are cached per endpoint, the ``MAX_CHANNELS`` most recently used: peers come
    and go (a restarted pod answers at a new address), and a channel per endpoint ever seen
    kept its sockets and reconnect timers for good. Evicting one cancels what is still in
    flight on it (a handshake fails and its fetch falls back; a lease release is left to
    expire), which only a decode worker pulling from more peers than that at once sees."""

    MAX_CHANNELS = 64

    def __init__(self, timeout_s: float, tp_rank: int = 0, auth: InternalAuth = NO_AUTH) -> None:
        self.timeout_s = timeout_s
        self.tp_rank = tp_rank
        self.auth = auth
        # endpoint -> (channel, stub), least recently used first
        self._peers: OrderedDict[str, tuple[grpc.Channel, pb_grpc.PrefillServiceStub]] = (
            OrderedDict()
        )
        self._releases: set[grpc.Future] = set()  # in flight (a dropped one is cancelled)
        self._lock = threading.Lock()

    def __call__(self, endpoint: str) -> bytes:
        request = pb.TransferMetadataRequest(tp_rank=self.tp_rank)
        return self._stub(endpoint).GetTransferMetadata(request, timeout=self.timeout_s).metadata

    def release_lease(self, endpoint: str, lease_id: str) -> None:
        """Fire and forget ``ReleaseKV(lease_id)`` at ``endpoint``; never blocks (called
        on the engine thread). If it fails, the lease just expires."""
        call = self._stub(endpoint).ReleaseKV.future(
            pb.ReleaseKVRequest(lease_id=lease_id), timeout=5.0
        )
        with self._lock:
            self._releases.add(call)
        call.add_done_callback(self._released)

    def _released(self, call: grpc.Future) -> None:
        with self._lock:
            self._releases.discard(call)

    def _stub(self, endpoint: str) -> pb_grpc.PrefillServiceStub:
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is not None:
                self._peers.move_to_end(endpoint)
                return peer[1]
            while len(self._peers) >= self.MAX_CHANNELS:
                _, (old_channel, _) = self._peers.popitem(last=False)
                old_channel.close()
            channel = self.auth.channel(endpoint)
            stub = pb_grpc.PrefillServiceStub(channel)
            self._peers[endpoint] = (channel, stub)
            return stub

    @property
    def num_channels(self) -> int:
        with self._lock:
            return len(self._peers)

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._peers.values():
                channel.close()
            self._peers.clear()
