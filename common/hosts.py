"""Hosts as the config names them: which addresses one stands for on this machine, why it
stands for none, and how to write it before a port.

A configured host is checked when the config is built (``common/config.py``), so a typo
("127.0.0.l", "localhst") is one error naming its key, not a failed bind or a connect
retried for ever later. An IP literal needs no lookup; a name is looked up once, with
getaddrinfo, as the servers bind it (``common/listen_sockets.py``).

An IPv6 literal goes in brackets wherever a port follows it: URLs, gRPC targets and ZMQ
endpoints all read ``[::1]:8000``; ``::1:8000`` is no address at all.
"""

from __future__ import annotations

import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LOOPBACK = {4: "127.0.0.1", 6: "::1"}


class HostError(ValueError):
    """A host that stands for no address here; its message is the one-line reason."""


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an IP address, when it is one written out (no lookup)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_addresses(host: str) -> frozenset[IPAddress]:
    """The addresses a server bound to ``host`` listens on (getaddrinfo with AI_PASSIVE,
    as ``bind_listeners`` binds them). Raises ``HostError`` for a host with none."""
    literal = ip_literal(host)
    if literal is not None:
        return frozenset({literal})
    if not host:
        raise HostError("must not be empty")
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:  # (UnicodeError: a label IDNA cannot encode)
        reason = _hint(host) or getattr(exc, "strerror", None) or str(exc)
        raise HostError(f"cannot resolve {host!r}: {reason}") from None
    families = (socket.AF_INET, socket.AF_INET6)
    return frozenset(
        ipaddress.ip_address(address[0]) for family, *_, address in infos if family in families
    )


def _hint(host: str) -> str | None:
    """What an unresolvable host was probably meant as, where its form says so."""
    if host == "*":
        return "no address ('0.0.0.0' is every IPv4 interface, '::' every IPv6 one)"
    if host.startswith("[") and host.endswith("]"):
        return f"write an IPv6 address without brackets ({host[1:-1]!r})"
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        return f"a host without its port ({name!r}; the port is a key of its own)"
    return None


def socket_family(host: str) -> socket.AddressFamily:
    """The family a socket to or on ``host`` takes: an IP literal's own; for a name IPv4
    where it has an IPv4 address (as before IPv6 hosts were served: ``localhost`` stays
    127.0.0.1 where /etc/hosts also maps it to ::1), IPv6 where it has IPv6 ones only;
    IPv4 for a name that does not resolve (the socket's own error then says so)."""
    literal = ip_literal(host)
    if literal is not None:
        return socket.AF_INET6 if literal.version == 6 else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return socket.AF_INET
    families = {family for family, *_ in infos}
    return socket.AF_INET6 if families == {socket.AF_INET6} else socket.AF_INET


def url_host(host: str) -> str:
    """``host`` as it is written before ``:port``: an IPv6 literal in brackets."""
    literal = ip_literal(host)
    return f"[{host}]" if literal is not None and literal.version == 6 else host


def host_port(host: str, port: int) -> str:
    """``host:port`` for a URL, a gRPC target or a ZMQ endpoint (``[::1]:8000``)."""
    return f"{url_host(host)}:{port}"


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is an unspecified address (0.0.0.0, ::): every interface."""
    literal = ip_literal(host)
    return literal is not None and literal.is_unspecified


def local_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``: the loopback of a
    wildcard's family (``http://0.0.0.0:8000`` is no address to give anyone), else
    ``host`` itself."""
    literal = ip_literal(host)
    if literal is not None and literal.is_unspecified:
        return _LOOPBACK[literal.version]
    return host


def addresses_overlap(first: frozenset[IPAddress], second: frozenset[IPAddress]) -> bool:
    """Whether servers bound to these addresses would want the same port: they share an
    address, or either is a wildcard. A wildcard is taken to cover both families: ``::``
    is dual-stack where a server leaves IPV6_V6ONLY off (gRPC does)."""
    return bool(first & second) or any(address.is_unspecified for address in first | second)
