"""Bound TCP sockets for a configured ``host`` and ``port``, before a server starts, as
asyncio's ``create_server(host, port)`` binds them: one per address the host resolves
to (``localhost``: 127.0.0.1 and ::1), IPv6 ones IPv6-only, ``SO_REUSEADDR`` on. Binding
first lets a process refuse a port in use with one error naming it, before it loads
anything (``router/main.py``), and lets ``pdserve up`` check every port first."""

from __future__ import annotations

import errno
import socket

from common.config import WorkerPorts
from common.config_base import ConfigError
from common.hosts import host_port


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """The bound (not yet listening) sockets; ``OSError`` (its ``strerror`` says why:
    in use, no such address) when any address cannot be bound, none left open."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, address) for family, _, _, _, address in infos))
    sockets: list[socket.socket] = []
    unavailable: OSError | None = None
    try:
        for family, address in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                # A family the host has turned off (::1 without IPv6), skipped as asyncio
                # skips it; an error only when no address is left.
                sockets.pop().close()
                unavailable = exc
        if not sockets and unavailable is not None:
            raise unavailable
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def listen_error(
    port_key: str,
    host: str,
    port: int,
    exc: OSError,
    in_use: str = "another process has it",
    name: str = "",
) -> ConfigError:
    """Why ``host:port`` could not be bound, blamed on the key a user would change: the
    section's host when it resolves no more or is none of this machine's addresses, else
    the port (``port_key``), with ``in_use`` said only where it is (a port below 1024
    refused without privileges is not another process's). ``name``: which of a
    worker's ports, after the address (``decode.port`` names five)."""
    host_key = f"{port_key.partition('.')[0]}.host"
    reason = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror):
        return ConfigError(host_key, f"cannot resolve {host!r}: {reason}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(host_key, f"{host} is not an address of this machine ({reason})")
    busy = f" ({in_use})" if exc.errno == errno.EADDRINUSE else ""
    what = f" ({name})" if name else ""
    return ConfigError(port_key, f"cannot listen on {host_port(host, port)}{what}: {reason}{busy}")


def worker_listeners(ports: WorkerPorts, connector: str) -> list[tuple[str, int]]:
    """What a worker listens on, named, on its role's host: gRPC, the KV events and their
    replay, and the NCCL connector's control socket and rendezvous store (the other
    connectors have no port of their own)."""
    listeners = [("gRPC", ports.grpc), ("KV events", ports.events), ("replay", ports.replay)]
    if connector == "nccl":
        listeners += [("kv_transfer", ports.kv_transfer), ("kv_store", ports.kv_store)]
    return listeners


def port_in_use(host: str, listeners: list[tuple[str, int]]) -> str | None:
    """The first of ``listeners`` that cannot listen on ``host`` now, said as
    ``"<host>:<port> (<name>): <why>"``; None when all can (each probed and closed)."""
    for name, port in listeners:
        try:
            for probe in bind_listeners(host, port):  # as the servers will
                probe.close()
        except OSError as exc:
            return f"{host_port(host, port)} ({name}): {exc.strerror or exc}"
    return None
