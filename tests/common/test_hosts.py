"""Configured hosts: which addresses one stands for, the reason one stands for none, and
how it is written before a port (an IPv6 literal in brackets: ``::1:8000`` was no
address, and a router on ``::1`` was polled at ``http://::1:8000``)."""

from __future__ import annotations

import ipaddress
import socket
import threading
from urllib.parse import urlsplit

import pytest

from common.hosts import (
    HostError,
    addresses_overlap,
    host_addresses,
    host_port,
    local_host,
    url_host,
)
from common.listen_sockets import bind_listeners
from deploy.health_cmd import check_http

V4, V6 = ipaddress.IPv4Address, ipaddress.IPv6Address


def test_literals_and_resolvable_names_have_addresses():
    assert host_addresses("127.0.0.1") == {V4("127.0.0.1")}
    assert host_addresses("::1") == {V6("::1")}
    assert host_addresses("0.0.0.0") == {V4("0.0.0.0")}
    assert V4("127.0.0.1") in host_addresses("localhost")
    assert host_addresses("::") == {V6("::")}


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("localhst", "cannot resolve 'localhst': "),
        ("127.0.0.l", "cannot resolve '127.0.0.l': "),  # (an l for a 1)
        ("[::1]", "write an IPv6 address without brackets ('::1')"),
        ("localhost:8000", "a host without its port ('localhost'; the port is a key"),
        ("*", "no address ('0.0.0.0' is every IPv4 interface, '::' every IPv6 one)"),
        ("a" * 64 + ".example", "cannot resolve 'aaaa"),  # (a label IDNA cannot encode)
        ("", "must not be empty"),
    ],
)
def test_a_host_without_addresses_is_one_line_saying_why(host, reason):
    with pytest.raises(HostError) as error:
        host_addresses(host)
    problem = str(error.value)
    assert reason in problem, problem
    assert "\n" not in problem


def test_an_ipv6_literal_is_bracketed_before_its_port():
    assert host_port("::1", 8000) == "[::1]:8000"
    assert host_port("fd00::5", 18100) == "[fd00::5]:18100"
    assert url_host("::") == "[::]"
    assert host_port("127.0.0.1", 8000) == "127.0.0.1:8000"
    assert host_port("localhost", 8000) == "localhost:8000"


def test_a_wildcard_is_reached_on_its_familys_loopback():
    assert local_host("0.0.0.0") == "127.0.0.1"
    assert local_host("::") == "::1"
    assert local_host("::1") == "::1" and local_host("localhost") == "localhost"


def test_addresses_overlap_where_servers_would_share_a_port():
    loopback, lan = host_addresses("127.0.0.1"), host_addresses("10.1.2.3")
    assert addresses_overlap(loopback, host_addresses("localhost"))
    assert addresses_overlap(loopback, host_addresses("0.0.0.0"))
    assert addresses_overlap(host_addresses("::1"), host_addresses("::"))
    assert addresses_overlap(loopback, host_addresses("::"))  # (dual-stack where not V6ONLY)
    assert not addresses_overlap(loopback, lan)
    assert not addresses_overlap(loopback, host_addresses("::1"))


def _serve_one_http_reply(sock: socket.socket) -> threading.Thread:
    sock.listen()

    def answer() -> None:
        connection, _ = sock.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_a_url_built_from_an_ipv6_host_reaches_a_server_there():
    (sock,) = bind_listeners("::1", 0)
    with sock:
        port = sock.getsockname()[1]
        thread = _serve_one_http_reply(sock)
        assert urlsplit(f"http://::1:{port}/health").hostname is None  # (no host in it)
        url = f"http://{host_port('::1', port)}/health"
        assert urlsplit(url).hostname == "::1"
        healthy, line = check_http(url, 5.0)
        assert healthy, line
        thread.join(5)
