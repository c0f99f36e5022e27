"""Peers that froze (a hung process, a host that stopped answering) hold only their own
fetches: each handshake with one blocks in its metadata call for the whole timeout, and
fetches from healthy peers meanwhile start and land at once. NIXL ran handshakes on two
threads, so two frozen prefill workers held back every other peer's fetch past its
deadline."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_transfer import KVTransferConfig, PeerRef, create_connector
from kv_transfer.errors import HandshakeError, KVTransferError

SHAPE = (16, 2, 4, 2, 8)  # 16 blocks
TIMEOUT_S = 6.0
NUM_FROZEN = 4  # more than NIXL's old two handshake threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("connector", ["nixl", "nccl"])
def test_frozen_peers_do_not_hold_back_a_healthy_one(connector):
    config = KVTransferConfig(connector=connector, timeout_s=TIMEOUT_S)
    known: dict[str, bytes] = {}
    thawed = threading.Event()  # set at the end: the frozen calls return

    def fetch_metadata(endpoint: str) -> bytes:
        if endpoint.startswith("frozen"):  # as a gRPC call to a hung peer: its deadline
            thawed.wait(TIMEOUT_S)
            raise TimeoutError(f"{endpoint} did not answer")
        return known[endpoint]

    source = [torch.randn(SHAPE) for _ in range(2)]
    dest = [torch.zeros(SHAPE) for _ in range(2)]
    exporter = create_connector(config, "healthy", fetch_metadata)
    fetcher = create_connector(config, "fetcher", fetch_metadata)
    try:
        exporter.register_kv_caches(source)
        fetcher.register_kv_caches(dest)
        known["healthy"] = exporter.metadata()
        for i in range(NUM_FROZEN):
            peer = PeerRef(f"frozen-{i}", f"frozen-{i}")
            fetcher.start_fetch(f"frozen-{i}", peer, [i], [i])
        time.sleep(0.3)  # their handshakes are waiting on the frozen peers

        started = time.monotonic()
        exporter.export_blocks("t1", [3, 7])
        fetcher.start_fetch("t1", PeerRef("healthy", "healthy"), [3, 7], [9, 10])
        fetcher.wait("t1", timeout_s=30)
        elapsed_s = time.monotonic() - started
        assert elapsed_s < TIMEOUT_S / 3, f"the healthy fetch waited {elapsed_s:.1f} s"
        assert all(torch.equal(d[[9, 10]], s[[3, 7]]) for d, s in zip(dest, source, strict=True))

        thawed.set()
        for i in range(NUM_FROZEN):
            with pytest.raises(HandshakeError):
                fetcher.wait(f"frozen-{i}", timeout_s=30)
        assert fetcher.num_active_fetches == 0
    finally:
        thawed.set()
        fetcher.close()
        exporter.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("connector", ["nixl", "nccl"])
def test_fetches_queued_on_a_frozen_peer_fail_with_its_first_handshake(connector):
    """A second fetch from a frozen peer, submitted while the first one's handshake hangs,
    fails when that handshake does: NCCL's fetcher thread ran a second handshake for it
    and failed it a whole timeout later, near twice its own deadline."""
    timeout_s = 3.0
    config = KVTransferConfig(connector=connector, timeout_s=timeout_s)
    calls: list[str] = []

    def fetch_metadata(endpoint: str) -> bytes:  # a hung peer: the gRPC deadline
        calls.append(endpoint)
        time.sleep(timeout_s)
        raise TimeoutError(f"{endpoint} did not answer")

    fetcher = create_connector(config, "fetcher", fetch_metadata)
    try:
        fetcher.register_kv_caches([torch.zeros(SHAPE) for _ in range(2)])
        peer = PeerRef("frozen", "frozen")
        started = time.monotonic()
        fetcher.start_fetch("first", peer, [0], [0])
        time.sleep(timeout_s / 2)
        fetcher.start_fetch("second", peer, [1], [1])
        for transfer_id in ("first", "second"):  # (or its deadline, a moment earlier)
            with pytest.raises(KVTransferError):
                fetcher.wait(transfer_id, timeout_s=30)
        elapsed_s = time.monotonic() - started
        assert elapsed_s < timeout_s * 1.6, f"the second fetch failed after {elapsed_s:.1f} s"
        assert calls == ["frozen"]
        assert fetcher.num_active_fetches == 0
    finally:
        fetcher.close()
