"""The router binds every address its host resolves to, as uvicorn's own bind did
(``localhost``: 127.0.0.1 and, where the host has it, ::1); a port in use anywhere is an
OSError with nothing left bound."""

from __future__ import annotations

import errno
import socket

import pytest

from common.listen_sockets import bind_listeners


def test_every_address_of_the_host_is_bound_and_a_held_port_leaves_nothing_bound():
    families = {info[0] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    sockets = bind_listeners("localhost", 0)
    try:
        assert {sock.family for sock in sockets} == families
    finally:
        for sock in sockets:
            sock.close()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError) as refused:
            bind_listeners("127.0.0.1", port)
        assert refused.value.strerror == "Address already in use"
    again = bind_listeners("127.0.0.1", port)  # nothing of the failed try held it
    for sock in again:
        sock.close()


def test_an_address_that_is_not_this_hosts_is_an_error_when_no_other_is_bound():
    """(An unavailable one among others, ::1 without IPv6, is skipped, as asyncio does.)"""
    with pytest.raises(OSError) as refused:
        bind_listeners("192.0.2.1", 0)  # TEST-NET-1: never this host's
    assert refused.value.errno == errno.EADDRNOTAVAIL
