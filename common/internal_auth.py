"""A shared secret on the internal gRPC ports (router -> workers, worker -> worker).

Without it, anything that reaches a worker's gRPC port can ask ``GetTransferMetadata`` for
the NIXL agent's metadata and KV addresses and then READ every tenant's cached prompts
(a one-sided READ the exporter cannot limit to leased blocks), or send a decode worker a
forged ``KVHandle`` whose pulled blocks then sit in its prefix cache under another
prompt's hashes. With ``PDSERVE_INTERNAL_TOKEN`` set in every process of a deployment,
each call carries it (``x-pdserve-token``) and a worker refuses a call without it
(UNAUTHENTICATED), constant-time compared. The standard health service stays open, for
orchestrators' probes (it says SERVING or not, nothing else). Empty (the variable unset):
no check, no interceptor on any call, as before.

``pdserve up`` hands the variable to its children (it warns when workers listen beyond
this machine without one); compose passes the host's variable through; Kubernetes reads
it from the Secret ``pdserve-internal-token`` when one exists, beside a NetworkPolicy that
admits the internal ports only from the deployment's own pods (``deploy/k8s_pods.py``).
Workers started by hand to join a deployment need the same value. The NCCL connector's
control socket (ZMQ) is covered through the handshake: a pair opens only for a peer that
proves it knows a key the exporter hands out in its transfer metadata, a gRPC answer
(``kv_transfer/nccl_protocol.py``). The KV-event ports (ZMQ) are not covered: they take no
writes but subscriptions (bounded at 64 bytes each: ``common/event_bus.py``) and replay
requests (8 bytes, one answered per connection), and carry block hashes only (the blocks'
tokens are not sent), which tell a listener which prompts it could guess are cached; keep
them on the deployment's network (the NetworkPolicy does on Kubernetes). A router sends
the token to every worker the registry lists, so the registry must be the deployment's
too. The token is a bearer secret on a
plaintext channel: it keeps out whoever cannot see the traffic, not whoever can sniff it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from common.config_base import ConfigError

TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
TOKEN_KEY = "x-pdserve-token"
_OPEN_SERVICE = "/grpc.health.v1.Health/"
ChannelOptions = Sequence[tuple[str, Any]] | None


@dataclass(frozen=True, slots=True)
class InternalAuth:
    token: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> InternalAuth:
        """The token in ``PDSERVE_INTERNAL_TOKEN``, without the whitespace around it (a
        Secret made ``--from-file`` ends with a newline). Raises ``ConfigError`` for
        characters a gRPC header cannot carry: every call, health checks too, would fail
        with "invalid metadata" (the router's start failed on an unrelated-looking error)."""
        token = environ.get(TOKEN_ENV, "").strip()
        if any(not " " < char <= "~" for char in token):
            raise ConfigError(TOKEN_ENV, "must be printable ASCII without spaces")
        return cls(token)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_CheckToken(self.token)] if self.token else []

    def aio_channel(self, address: str, options: ChannelOptions = None) -> grpc.aio.Channel:
        # One interceptor per kind of call: a channel files an object that is both under
        # the first kind alone, and streams went without the token.
        interceptors = [_AddToken(self.token), _AddTokenStream(self.token)] if self.token else None
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)

    def channel(self, address: str, options: ChannelOptions = None) -> grpc.Channel:
        channel = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(channel, _AddTokenSync(self.token)) if self.token else channel


NO_AUTH = InternalAuth()  # (frozen: a shared default)


def open_ports_warning(hosts: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """What to tell an operator whose workers listen on an address other machines reach
    (not loopback) with no token set; None otherwise."""
    if environ.get(TOKEN_ENV):
        return None
    exposed = sorted({host for host in hosts if not _loopback(host)})
    if not exposed:
        return None
    return (f"workers listen on {', '.join(exposed)} and {TOKEN_ENV} is not set: whoever "
            "reaches their gRPC ports can read every cached prompt's KV and write into "
            "their caches; set it to one secret in every process of the deployment")  # fmt: skip


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def _with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (TOKEN_KEY, token)]


def _aio_details(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*_with_token(details.metadata, token))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _AddToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._token), request)


class _AddTokenStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._token), request)


class _AddTokenSync(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: Any) -> Any:
        return _SyncDetails(
            details.method, details.timeout, _with_token(details.metadata, self._token),
            details.credentials, getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


@dataclass(frozen=True, slots=True)
class _SyncDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _CheckToken(grpc.aio.ServerInterceptor):
    """Refuses every call without the token, but the health service's."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_SERVICE):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(str(given).encode(), self._token):
            return handler
        return _refusal(handler)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"a valid {TOKEN_KEY} is required")


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext):
    await _refuse(request, context)
    yield  # (an async generator, as a server-streaming handler is)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that refuses the call before a byte of its request is read: a
    request-streaming one, whatever the method's kind (the wire is the same; the reply
    keeps the method's kind), which runs once the call's headers are in. A unary
    handler ran once the whole request was: up to the server's message limit (64 MiB
    or more) held for each call of a caller refused anyway, and 32 such calls at once
    grew a worker by 2.3 GB (a security audit, 2026-12-02)."""
    codecs = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None or handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream, **codecs)
    return grpc.stream_unary_rpc_method_handler(_refuse, **codecs)
