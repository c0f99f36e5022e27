"""``fetch_peer_metadata(endpoint)`` for connectors: GetTransferMetadata over gRPC."""

from __future__ import annotations

import threading

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


class PeerMetadataClient:
    """Asks a peer worker for the handshake metadata of its connector of rank ``tp_rank``
    (the same rank as ours: rank r pairs with rank r). Called from connector threads;
    channels are cached per endpoint."""

    def __init__(self, timeout_s: float, tp_rank: int = 0) -> None:
        self.timeout_s = timeout_s
        self.tp_rank = tp_rank
        self._stubs: dict[str, pb_grpc.PrefillServiceStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def __call__(self, endpoint: str) -> bytes:
        with self._lock:
            stub = self._stubs.get(endpoint)
            if stub is None:
                channel = grpc.insecure_channel(endpoint)
                self._channels.append(channel)
                stub = self._stubs[endpoint] = pb_grpc.PrefillServiceStub(channel)
        request = pb.TransferMetadataRequest(tp_rank=self.tp_rank)
        return stub.GetTransferMetadata(request, timeout=self.timeout_s).metadata

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()
