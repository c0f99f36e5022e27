"""The router binds every address its host resolves to, as uvicorn's own bind did
(``localhost``: 127.0.0.1 and, where the host has it, ::1); a port in use anywhere is an
OSError with nothing left bound."""

from __future__ import annotations

import errno
import socket

import pytest

from common.listen_sockets import bind_listeners, listen_error


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


def test_a_failed_bind_blames_the_key_to_change():
    """The router said "another process has the port, or the host is not this machine's"
    whatever the cause; now each cause names its key, and "in use" only where it is."""
    with pytest.raises(OSError) as not_here:
        bind_listeners("192.0.2.1", 0)  # TEST-NET-1: no machine's address
    error = listen_error("router.port", "192.0.2.1", 8000, not_here.value)
    assert error.key == "router.host" and "not an address of this machine" in str(error)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError) as in_use:
            bind_listeners("127.0.0.1", port)
    error = listen_error("decode.port", "127.0.0.1", port, in_use.value, in_use="another stack?")
    assert error.key == "decode.port" and str(error).endswith("in use (another stack?)")
    refused = OSError(errno.EACCES, "Permission denied")
    error = listen_error("router.port", "127.0.0.1", 80, refused)
    assert str(error) == "router.port: cannot listen on 127.0.0.1:80: Permission denied"
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    error = listen_error("prefill.port", "localhst", 9000, unknown)
    assert error.key == "prefill.host" and "cannot resolve 'localhst'" in str(error)
