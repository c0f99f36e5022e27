"""``fetch_peer_metadata(endpoint)`` for connectors: GetTransferMetadata over gRPC; and
``release_lease``: a decode worker's ReleaseKV for a lease it will never pull."""

from __future__ import annotations

import threading

import grpc

from common.internal_auth import NO_AUTH, InternalAuth
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


class PeerMetadataClient:
    """Asks a peer worker for the handshake metadata of its connector of rank ``tp_rank``
    (the same rank as ours: rank r pairs with rank r). Called from connector threads;
    channels are cached per endpoint."""

    def __init__(self, timeout_s: float, tp_rank: int = 0, auth: InternalAuth = NO_AUTH) -> None:
        self.timeout_s = timeout_s
        self.tp_rank = tp_rank
        self.auth = auth
        self._stubs: dict[str, pb_grpc.PrefillServiceStub] = {}
        self._channels: list[grpc.Channel] = []
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
            stub = self._stubs.get(endpoint)
            if stub is None:
                channel = self.auth.channel(endpoint)
                self._channels.append(channel)
                stub = self._stubs[endpoint] = pb_grpc.PrefillServiceStub(channel)
            return stub

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()
