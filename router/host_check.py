"""Which ``Host`` headers a router on a loopback address answers, against DNS rebinding.

A web page on another site can make a visitor's browser send requests to a router on
127.0.0.1 by pointing its own host name at 127.0.0.1 after the page has loaded (DNS
rebinding): the browser then counts the router as the page's own origin, so CORS does not
stop it, and a router without API keys ran whatever the page asked (a security audit,
2026-12-02; a local Ollama server had the same hole in 2024). The one thing such a request
cannot hide is its ``Host`` header, which names the attacker's host. So a router whose
``router.host`` is a loopback address and that has no API keys answers only requests
whose ``Host`` is a loopback name (``localhost``, 127.0.0.0/8, ``::1``) or one of
``router.allowed_hosts`` (a reverse proxy's public name, say; ``"*"``: any). A router on
another address, or one with keys, takes any ``Host`` (a key is what a page cannot know).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from common.hosts import HostError, host_addresses, ip_literal
from router.errors import APIError


def guards_hosts(router_host: str, api_keys: Collection[str], allowed: Collection[str]) -> bool:
    """Whether a router with these settings checks ``Host`` headers (module docstring):
    its host is loopback by name or by every address it resolves to (``ip6-localhost``,
    a machine's own name mapped to 127.0.1.1)."""
    if api_keys or "*" in allowed:
        return False
    if is_loopback_name(router_host):
        return True
    try:
        addresses = host_addresses(router_host)
    except HostError:
        return False
    return bool(addresses) and all(address.is_loopback for address in addresses)


def is_loopback_name(host: str) -> bool:
    literal = ip_literal(host)
    return _plain(host) == "localhost" or (literal is not None and literal.is_loopback)


def host_name(header: str) -> str:
    """The host a ``Host`` header names, without its port or an IPv6 address's brackets
    (the header itself where it is no host and port)."""
    if header.startswith("["):
        address, bracket, rest = header[1:].partition("]")
        port_ok = rest == "" or (rest.startswith(":") and rest[1:].isdigit())
        return address if bracket and port_ok else header
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() else header


def _plain(name: str) -> str:
    """A host name as compared: lower case, without a trailing dot (``localhost.``)."""
    return name.lower().removesuffix(".")


class LoopbackHosts:
    """ASGI middleware refusing (400, the OpenAI envelope) HTTP requests whose ``Host``
    names neither a loopback address nor one of ``allowed`` (the router's own host among
    them: ``pdserve up`` polls it by that name). A request without ``Host`` (HTTP/1.0)
    is answered: browsers always send one."""

    def __init__(
        self, app: ASGIApp, allowed: Collection[str], respond: Callable[[APIError], Response]
    ) -> None:
        self.app, self.respond = app, respond
        self.allowed = frozenset(_plain(name) for name in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        header = Headers(scope=scope).get("host") if scope["type"] == "http" else None
        if header:
            name = _plain(host_name(header))
            if not is_loopback_name(name) and name not in self.allowed:
                error = APIError(400, f"this router (on a loopback address, without API keys) "
                                 f"answers requests to localhost, 127.0.0.1 or [::1], not to "
                                 f"{name!r}: add the name to router.allowed_hosts (a reverse "
                                 "proxy's), or set router.api_keys")  # fmt: skip
                await self.respond(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
