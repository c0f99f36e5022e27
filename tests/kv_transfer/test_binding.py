"""Every socket a connector opens listens on the configured host (127.0.0.1 by default),
never on every interface: checked from /proc after a real transfer, in one process."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
import torch

from kv_transfer import KVTransferConfig
from tests.kv_transfer.pair import wired_pair

SHAPE = (8, 2, 4, 2, 16)  # [num_blocks, 2, block_size, H, D]


def listening_addresses() -> dict[str, str]:
    """inode -> local address of this process's listening TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found[fields[9]] = fields[1].split(":")[0]
    return found


def is_loopback(hex_address: str) -> bool:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1]).is_loopback  # /proc prints little-endian
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return address.is_loopback or bool(address.ipv4_mapped and address.ipv4_mapped.is_loopback)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("connector", "host"), [("nixl", "127.0.0.1"), ("nccl", "127.0.0.1"), ("nccl", "::1")]
)
def test_listeners_stay_on_loopback_and_close_with_the_connector(connector, host):
    """On an IPv6 host too (an IPv6-only cluster's pod IP): the NCCL connector's store,
    control socket and gloo pairs took IPv4 alone. (NIXL's own sockets are UCX's: the
    host only keeps them on loopback, as the IPv4 case checks.)"""
    before = listening_addresses()
    config = KVTransferConfig(connector=connector, host=host, timeout_s=10)
    src = [torch.randn(SHAPE) for _ in range(2)]
    dst = [torch.zeros(SHAPE) for _ in range(2)]
    exporter, fetcher, peer = wired_pair(config, f"bind-{connector}", src, dst)
    try:
        exporter.export_blocks("bind", [1, 2])
        fetcher.start_fetch("bind", peer, [1, 2], [3, 4])
        fetcher.wait("bind", 10)  # pairs, process groups and UCX endpoints now exist
        assert all(torch.equal(d[[3, 4]], s[[1, 2]]) for s, d in zip(src, dst, strict=True))
        opened = {k: v for k, v in listening_addresses().items() if k not in before}
        assert opened, "expected the connector to listen somewhere"
        assert all(is_loopback(address) for address in opened.values()), opened
        if host == "::1":  # (/proc prints ::1 as 16 bytes: 4-byte words, little-endian)
            assert set(opened.values()) == {"00000000000000000000000001000000"}, opened
    finally:
        exporter.close()
        fetcher.close()
    if connector == "nixl":  # close() frees its listeners, not garbage collection
        left = {k: v for k, v in listening_addresses().items() if k not in before}
        assert not left, f"still listening after close: {left}"
        assert exporter and fetcher  # still alive here


_CONTROL_PORT_IN_USE = """
import socket, sys, torch, zmq
from kv_transfer import KVTransferConfig
from kv_transfer.nccl import NcclConnector
held = socket.create_server(("127.0.0.1", 0))
connector = NcclConnector(KVTransferConfig(connector="nccl", port=held.getsockname()[1]), "e")
try:
    connector.register_kv_caches([torch.zeros(SHAPE) for _ in range(2)])
except zmq.ZMQError as exc:
    print("refused:", exc, flush=True)
    connector.close()  # as a worker does: its traceback (and the frame) still alive
    print("closed", flush=True)
"""


def test_a_control_port_in_use_fails_registration_and_close_returns():
    """The NCCL connector's control port in use: registration fails, and close() then
    returns. The socket that failed to bind was left open (held by the traceback's
    frame while the failure was handled) and the context's term() waited on it for
    ever: a worker hung at exit instead of failing."""
    import subprocess
    import sys

    from tests.support.processes import ROOT

    code = _CONTROL_PORT_IN_USE.replace("SHAPE", repr(SHAPE))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert "refused: Address already in use" in child.stdout and "closed" in child.stdout
