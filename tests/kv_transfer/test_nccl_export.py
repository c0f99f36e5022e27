"""The NCCL exporter's control loop survives what a peer may send it."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import torch
import zmq

from kv_transfer import KVTransferConfig
from kv_transfer.handshake import PeerMetadata
from kv_transfer.nccl_protocol import Accepted, Connect, NcclPayload, decode_to_fetcher, encode
from tests.kv_transfer.pair import wired_pair

SHAPE = (8, 2, 4, 2, 16)


def _control_port(exporter) -> int:
    envelope = msgspec.msgpack.decode(exporter.metadata(), type=PeerMetadata)
    return msgspec.msgpack.decode(envelope.transport, type=NcclPayload).control_port


@pytest.mark.timeout(60)
def test_malformed_control_messages_are_dropped_and_the_exporter_still_serves():
    config = KVTransferConfig(connector="nccl", timeout_s=10)
    source = [torch.randn(SHAPE) for _ in range(2)]
    dest = [torch.zeros(SHAPE) for _ in range(2)]
    exporter, fetcher, peer = wired_pair(config, "ctl", source, dest)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{_control_port(exporter)}")
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


@pytest.mark.timeout(60)
def test_a_fetcher_that_connects_and_never_joins_does_not_stall_other_pairs():
    """A fetcher killed between ``Connect`` and the rendezvous leaves its pair's sender
    waiting on the store for ``timeout_s``; other pairs must rendezvous meanwhile. They
    shared one store object, which runs one operation at a time: the healthy fetch timed
    out behind the dead one (CI, test_fetcher_killed_mid_transfer[nccl])."""
    timeout_s = 8.0
    config = KVTransferConfig(connector="nccl", timeout_s=timeout_s)
    source = [torch.randn(SHAPE) for _ in range(2)]
    dest = [torch.zeros(SHAPE) for _ in range(2)]
    exporter, fetcher, peer = wired_pair(config, "stall", source, dest)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{_control_port(exporter)}")
        pair_id = uuid.uuid4().hex
        sock.send(encode(Connect(pair_id, "gone-fetcher", exporter.layout)))
        assert sock.poll(10_000), "no reply to Connect"
        assert decode_to_fetcher(sock.recv()) == Accepted(pair_id)
        time.sleep(0.3)  # the gone fetcher's sender is waiting for rank 1 now

        started = time.monotonic()
        exporter.export_blocks("t1", [1, 2, 5])
        fetcher.start_fetch("t1", peer, [1, 2, 5], [3, 4, 0])
        fetcher.wait("t1", timeout_s=30)
        elapsed_s = time.monotonic() - started
        assert elapsed_s < timeout_s / 2, f"the healthy fetch waited {elapsed_s:.1f} s"
        for src, dst in zip(source, dest, strict=True):
            assert torch.equal(dst[[3, 4, 0]], src[[1, 2, 5]])
        assert fetcher.num_active_fetches == 0
    finally:
        sock.close(0)
        context.term()
        fetcher.close()
        exporter.close()
