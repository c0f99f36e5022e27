"""The NCCL exporter's control loop survives what a peer may send it."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch
import zmq

from kv_transfer import KVConnector, KVTransferConfig, PeerRef
from kv_transfer.handshake import PeerMetadata
from kv_transfer.nccl_protocol import (
    MAX_ID_CHARS,
    Abort,
    Accepted,
    Connect,
    NcclPayload,
    Rejected,
    connect_proof,
    control_message_limit,
    decode_to_fetcher,
    encode,
)
from tests.kv_transfer.pair import wired_pair

SHAPE = (8, 2, 4, 2, 16)


def _payload(exporter) -> NcclPayload:
    envelope = msgspec.msgpack.decode(exporter.metadata(), type=PeerMetadata)
    return msgspec.msgpack.decode(envelope.transport, type=NcclPayload)


@dataclass
class Setup:
    exporter: KVConnector
    fetcher: KVConnector
    peer: PeerRef
    source: list[torch.Tensor]
    dest: list[torch.Tensor]
    sock: zmq.Socket  # a DEALER on the exporter's control socket

    def fetch_and_check(self) -> float:
        """Export and fetch three blocks; check them; the seconds it took."""
        started = time.monotonic()
        self.exporter.export_blocks("t1", [1, 2, 5])
        self.fetcher.start_fetch("t1", self.peer, [1, 2, 5], [3, 4, 0])
        self.fetcher.wait("t1", timeout_s=30)
        elapsed_s = time.monotonic() - started
        for src, dst in zip(self.source, self.dest, strict=True):
            assert torch.equal(dst[[3, 4, 0]], src[[1, 2, 5]])
        assert self.fetcher.num_active_fetches == 0
        return elapsed_s


@contextlib.contextmanager
def wired_with_a_control_socket(name: str, timeout_s: float) -> Iterator[Setup]:
    config = KVTransferConfig(connector="nccl", timeout_s=timeout_s)
    source = [torch.randn(SHAPE) for _ in range(2)]
    dest = [torch.zeros(SHAPE) for _ in range(2)]
    exporter, fetcher, peer = wired_pair(config, name, source, dest)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{_payload(exporter).control_port}")
        yield Setup(exporter, fetcher, peer, source, dest, sock)
    finally:
        sock.close(0)
        context.term()
        fetcher.close()
        exporter.close()


@pytest.mark.timeout(60)
def test_malformed_control_messages_are_dropped_and_the_exporter_still_serves():
    with wired_with_a_control_socket("ctl", timeout_s=10) as setup:
        setup.sock.send_multipart([b"two", b"frames"])  # the ROUTER sees three
        setup.sock.send(b"\xc1 not msgpack")
        setup.sock.send(msgspec.msgpack.encode({"type": "nonsense"}))
        setup.fetch_and_check()


@pytest.mark.timeout(60)
def test_a_fetcher_that_connects_and_never_joins_does_not_stall_other_pairs():
    """A fetcher killed between ``Connect`` and the rendezvous leaves its pair's sender
    waiting on the store for ``timeout_s``; other pairs must rendezvous meanwhile. They
    shared one store object, which runs one operation at a time: the healthy fetch timed
    out behind the dead one (CI, test_fetcher_killed_mid_transfer[nccl])."""
    timeout_s = 8.0
    with wired_with_a_control_socket("stall", timeout_s) as setup:
        pair_id = uuid.uuid4().hex
        proof = connect_proof(_payload(setup.exporter).pair_key, pair_id)
        setup.sock.send(encode(Connect(pair_id, "gone-fetcher", setup.exporter.layout, proof)))
        assert setup.sock.poll(10_000), "no reply to Connect"
        assert decode_to_fetcher(setup.sock.recv()) == Accepted(pair_id)
        time.sleep(0.3)  # the gone fetcher's sender is waiting for rank 1 now
        elapsed_s = setup.fetch_and_check()
        assert elapsed_s < timeout_s / 2, f"the healthy fetch waited {elapsed_s:.1f} s"


@pytest.mark.timeout(60)
def test_a_connect_without_the_exporters_key_opens_no_pair_and_learns_nothing():
    """The control socket took any Connect: 256 of them, sent without the internal
    token, filled every pair slot (real decode workers were turned away), and a wrong
    layout was answered with the exporter's own. A Connect now proves it knows the
    exporter's pair key, which only its handshake (gRPC, token-guarded) gives out."""
    with wired_with_a_control_socket("keyed", timeout_s=10) as setup:
        layout = setup.exporter.layout
        wrong = msgspec.structs.replace(layout, num_layers=layout.num_layers + 1)
        for proof in (b"", b"x" * 32, connect_proof(b"another key", "p")):
            for asked in (layout, wrong):
                pair_id = uuid.uuid4().hex
                setup.sock.send(encode(Connect(pair_id, "stranger", asked, proof)))
                assert setup.sock.poll(10_000), "no reply to Connect"
                reply = decode_to_fetcher(setup.sock.recv())
                assert isinstance(reply, Rejected) and not reply.layout_mismatch
                assert "not authorized" in reply.reason and "KVLayout" not in reply.reason
                assert ("no proof" in reply.reason) == (proof == b"")
        for _ in range(300):  # more than the exporter's pair slots
            setup.sock.send(encode(Connect(uuid.uuid4().hex, "stranger", layout)))
        for _ in range(300):
            assert setup.sock.poll(10_000)
            assert isinstance(decode_to_fetcher(setup.sock.recv()), Rejected)
        setup.fetch_and_check()  # the real fetcher still gets a pair


@pytest.mark.timeout(60)
def test_an_unauthenticated_peers_messages_are_bounded_and_said_once(caplog):
    """Before a proof is checked: a frame past what the longest FetchRequest needs is
    dropped by ZMQ (16 MiB frames took 0.25 s each to decode), an id past 256 characters
    is malformed (a 15 MiB pair id came back in each Rejected), and malformed messages
    are said once a minute, not each (five made 75 MiB of log)."""
    with wired_with_a_control_socket("bounded", timeout_s=10) as setup:
        layout = setup.exporter.layout
        # 8 blocks: the limit is 64 KiB + 40 bytes. ZMQ drops the sender for a longer
        # frame; a fresh socket reaches the exporter again.
        setup.sock.send(b"\x00" * (control_message_limit(8) + 1))
        long_id = "p" * (MAX_ID_CHARS + 1)
        with caplog.at_level(logging.INFO, logger="kv_transfer.nccl_export"):
            for _ in range(50):
                sock = setup.sock.context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(setup.sock.getsockopt_string(zmq.LAST_ENDPOINT))
                sock.send(encode(Connect(long_id, "stranger", layout, b"x" * 32)))
                sock.send(encode(Abort("lease-unknown")))
                sock.send_multipart([b"two", b"frames"])
                assert not sock.poll(200), "a reply to a malformed Connect"
                sock.close(0)
            setup.fetch_and_check()
        said = [r for r in caplog.records if "malformed" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert not [r for r in caplog.records if "lease-unknown" in r.getMessage()]
        assert all(len(r.getMessage()) < 1000 for r in caplog.records)
