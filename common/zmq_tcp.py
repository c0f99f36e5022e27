"""ZMQ sockets for ``tcp://`` endpoints on any configured host, IPv4 or IPv6.

libzmq's sockets are IPv4-only by default: ``tcp://[::1]:port`` fails to bind or connect
("No such device"), so a worker on an IPv6 address (an IPv6-only Kubernetes cluster's pod
IP) could not publish its KV events or answer a KV pull's control messages. Every TCP
socket the project opens to a configured host is made here, with ``zmq.IPV6`` on where the
host's family is IPv6 (``common.hosts.socket_family``). Only there: with it on, libzmq
resolves a name to its first IPv6 address, so a worker on ``localhost`` would publish on
::1 alone where /etc/hosts maps both, and one on a name with an unroutable AAAA record
would be unreachable; IPv4 hosts keep the sockets they had.
"""

from __future__ import annotations

import socket

import zmq

from common.hosts import socket_family


def tcp_socket(context: zmq.Context, kind: int, host: str) -> zmq.Socket:
    """A ``kind`` socket (``zmq.PUB``, ``zmq.DEALER``...) of ``context`` that binds or
    connects to ``host`` (an IPv6 one too), lingering 0 ms at close (no socket here
    waits to deliver what its peer will never read)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.IPV6, int(socket_family(host) == socket.AF_INET6))
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://host:port`` endpoint (an IPv6 address without brackets)."""
    address = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return address[1:-1] if address.startswith("[") else address
