"""ZMQ sockets for ``tcp://`` endpoints on any configured host, IPv4 or IPv6.

libzmq's sockets are IPv4-only by default: ``tcp://[::1]:port`` fails to bind or connect
("No such device"), so a worker on an IPv6 address (an IPv6-only Kubernetes cluster's pod
IP) could not publish its KV events or answer a KV pull's control messages. With the
``IPV6`` option on, a socket takes IPv6 addresses and IPv4 ones alike, so every TCP socket
the project opens to a configured host is made here, with the option set, whatever the host.
"""

from __future__ import annotations

import zmq


def tcp_socket(context: zmq.Context, kind: int) -> zmq.Socket:
    """A ``kind`` socket (``zmq.PUB``, ``zmq.DEALER``...) of ``context`` that binds or
    connects to IPv4 and IPv6 endpoints, lingering 0 ms at close (no socket here waits
    to deliver what its peer will never read)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.LINGER, 0)
    return sock
