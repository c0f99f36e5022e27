"""The rendezvous stores (tensor parallelism's, the NCCL connector's) listen on their host
alone: ``TCPStore`` by itself listened on every interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.tcp_store import bound_tcp_store


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (``/proc/net/tcp*``), as
    hex, e.g. 0100007F for 127.0.0.1 and 00000000 for every interface."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket tables")
def test_the_store_listens_on_its_host_alone():
    store = bound_tcp_store("127.0.0.1", 0, 1, timeout_s=5)
    store.set("key", b"value")
    assert store.get("key") == b"value"
    assert listening_addresses(store.port) == {"0100007F"}


@pytest.mark.skipif(not Path("/proc/net/tcp6").exists(), reason="needs IPv6")
def test_an_ipv6_host_gets_an_ipv6_store_that_a_client_reaches():
    """(The listener was made IPv4: an IPv6 address failed to bind, "Address family for
    hostname not supported".)"""
    import datetime

    import torch.distributed as dist

    store = bound_tcp_store("::1", 0, None, timeout_s=5)
    client = dist.TCPStore("::1", store.port, None, False, datetime.timedelta(seconds=5))
    client.set("key", b"value")
    assert store.get("key") == b"value"
    assert listening_addresses(store.port) == {"00000000000000000000000001000000"}  # ::1
