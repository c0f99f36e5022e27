"""The Host check of a keyless loopback router (its wiring: ``test_app.py``): which
routers check, and how a ``Host`` header is read."""

from __future__ import annotations

import socket

import pytest

from common.hosts import host_addresses
from router.host_check import guards_hosts, host_name


@pytest.mark.parametrize(
    ("header", "name"),
    [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
     ("api.example.com", "api.example.com"),
     # Not a host and port: the header itself, which then matches nothing allowed.
     ("[::1]evil.example", "[::1]evil.example"), ("[::1", "[::1")],
)  # fmt: skip
def test_a_host_header_is_read_as_its_host(header, name):
    assert host_name(header) == name


def test_a_router_on_loopback_by_name_or_by_address_checks_hosts():
    """By address too: a router on ``ip6-localhost`` or on the machine's own name mapped
    to 127.0.1.1 listened on loopback alone and took any Host (a review)."""
    assert guards_hosts("127.0.0.1", [], []) and guards_hosts("::1", [], [])
    assert guards_hosts("localhost", [], ["api.example.com"])
    assert not guards_hosts("0.0.0.0", [], []) and not guards_hosts("10.1.2.3", [], [])
    assert not guards_hosts("127.0.0.1", ["key"], []) and not guards_hosts("::1", [], ["*"])
    own = socket.gethostname()
    assert guards_hosts(own, [], []) == all(a.is_loopback for a in host_addresses(own))
