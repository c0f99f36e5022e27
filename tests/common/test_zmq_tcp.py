"""ZMQ sockets to configured hosts: IPv6 on for IPv6 hosts only (with it on, libzmq takes
a name's first IPv6 address, where an IPv4 one served before), and endpoint hosts read
back without brackets."""

from __future__ import annotations

import socket

import pytest
import zmq

from common.hosts import socket_family
from common.zmq_tcp import endpoint_host, tcp_socket


@pytest.mark.parametrize(
    ("host", "ipv6"),
    [("127.0.0.1", 0), ("::1", 1), ("fd00::5", 1), ("localhost", 0), ("no-such-host.invalid", 0)],
)
def test_ipv6_is_on_for_ipv6_hosts_alone(host, ipv6):
    sock = tcp_socket(zmq.Context.instance(), zmq.DEALER, host)
    try:
        assert sock.getsockopt(zmq.IPV6) == ipv6
        assert sock.getsockopt(zmq.LINGER) == 0
    finally:
        sock.close()


def test_a_name_with_ipv4_addresses_stays_ipv4(monkeypatch):
    """(DNS answers stood in for: no name here has both kinds of address.)"""
    both = [
        (socket.AF_INET6, 1, 6, "", ("::1", 0, 0, 0)),
        (socket.AF_INET, 1, 6, "", ("127.0.0.1", 0)),
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both)
    assert socket_family("dual.example") == socket.AF_INET
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both[:1])
    assert socket_family("v6only.example") == socket.AF_INET6


def test_endpoint_hosts_are_read_without_brackets():
    assert endpoint_host("tcp://[::1]:5557") == "::1"
    assert endpoint_host("tcp://127.0.0.1:5557") == "127.0.0.1"
    assert endpoint_host("tcp://prefill-0:18101") == "prefill-0"
