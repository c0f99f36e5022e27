"""The NCCL exporter's control loop survives what a peer may send it."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from kv_transfer import KVTransferConfig
from kv_transfer.handshake import PeerMetadata
from kv_transfer.nccl_protocol import NcclPayload
from tests.kv_transfer.pair import wired_pair

SHAPE = (8, 2, 4, 2, 16)


@pytest.mark.timeout(60)
def test_malformed_control_messages_are_dropped_and_the_exporter_still_serves():
    config = KVTransferConfig(connector="nccl", timeout_s=10)
    source = [torch.randn(SHAPE) for _ in range(2)]
    dest = [torch.zeros(SHAPE) for _ in range(2)]
    exporter, fetcher, peer = wired_pair(config, "ctl", source, dest)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        envelope = msgspec.msgpack.decode(exporter.metadata(), type=PeerMetadata)
        port = msgspec.msgpack.decode(envelope.transport, type=NcclPayload).control_port
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"two", b"frames"])  # the ROUTER sees three
        sock.send(b"\xc1 not msgpack")
        sock.send(msgspec.msgpack.encode({"type": "nonsense"}))

        exporter.export_blocks("t1", [1, 2, 5])
        fetcher.start_fetch("t1", peer, [1, 2, 5], [3, 4, 0])
        fetcher.wait("t1", timeout_s=30)
        for src, dst in zip(source, dest, strict=True):
            assert torch.equal(dst[[3, 4, 0]], src[[1, 2, 5]])
        assert fetcher.num_active_fetches == 0
    finally:
        sock.close(0)
        context.term()
        fetcher.close()
        exporter.close()
