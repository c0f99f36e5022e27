"""``PeerMetadataClient`` keeps a channel for the peers it talks to now, not for every
endpoint it ever saw (a decode worker outlives many prefill pods)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker.peer_metadata import PeerMetadataClient


class _Metadata(pb_grpc.PrefillServiceServicer):
    def GetTransferMetadata(self, request, context):
        return pb.TransferMetadataResponse(metadata=f"rank {request.tp_rank}".encode())


def test_channels_are_kept_for_the_most_recently_used_endpoints_only():
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PrefillServiceServicer_to_server(_Metadata(), server)
    live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    client = PeerMetadataClient(timeout_s=5.0, tp_rank=1)
    client.MAX_CHANNELS = 4
    try:
        assert client(live) == b"rank 1"
        for i in range(10):  # peers gone long ago (channels connect lazily: no call needed)
            client.release_lease(f"127.0.0.1:{40000 + i}", f"lease-{i}")
            assert client(live) == b"rank 1"  # the live peer stays the most recently used
        assert client.num_channels == 4
    finally:
        client.close()
        server.stop(None)
    assert client.num_channels == 0
