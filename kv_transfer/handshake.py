"""The handshake envelope: what ``KVConnector.metadata()`` serves and peers check.

Every connector publishes the same envelope (msgpack via msgspec, never pickle): who it is,
its KV layout and capacity, and an opaque transport section only that connector reads
(NIXL agent metadata and base addresses; NCCL ports; ...). The fetching side validates the
envelope before it touches any memory, so a layout mismatch transfers nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec

from kv_transfer.config import ConnectorName
from kv_transfer.errors import HandshakeError, MetadataUnavailableError
from kv_transfer.layout import KVLayout
from kv_transfer.records import PeerRef

HANDSHAKE_VERSION = 1

T = TypeVar("T")

MetadataFetcher = Callable[[str], bytes]
"""``fetch_peer_metadata(endpoint) -> bytes``: the peer's ``metadata()``, fetched over the
service's control channel (gRPC ``GetTransferMetadata``). It may block; connectors call it
on a background thread and may raise anything from it."""


class PeerMetadata(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    connector: str
    engine_id: str
    layout: KVLayout
    num_blocks: int
    transport: bytes = b""  # the connector's own section, msgpack-encoded by it


def encode_metadata(metadata: PeerMetadata) -> bytes:
    return msgspec.msgpack.encode(metadata)


def decode_peer_metadata(
    data: bytes,
    *,
    connector: ConnectorName,
    local_layout: KVLayout,
    engine_id: str | None = None,
) -> PeerMetadata:
    """Decode and validate a peer's envelope.

    Raises ``HandshakeError`` for undecodable bytes, another version, another connector,
    (when ``engine_id`` is given) another engine, or a block count no cache has;
    ``LayoutMismatchError`` for a layout that differs from ``local_layout``.
    """
    try:
        metadata = msgspec.msgpack.decode(data, type=PeerMetadata)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"undecodable peer metadata: {exc}") from exc
    if metadata.version != HANDSHAKE_VERSION:
        raise HandshakeError(
            f"peer speaks handshake version {metadata.version}, we speak {HANDSHAKE_VERSION}"
        )
    if metadata.connector != connector.value:
        raise HandshakeError(f"peer uses connector {metadata.connector!r}, we use {connector}")
    if engine_id is not None and metadata.engine_id != engine_id:
        raise HandshakeError(
            f"endpoint answered for engine {metadata.engine_id!r}, expected {engine_id!r}"
        )
    local_layout.check_compatible(metadata.layout)
    # Descriptor indices are int32 (NIXL); anything larger is no real cache.
    if not 0 <= metadata.num_blocks * max(1, metadata.layout.num_layers) < 2**31:
        raise HandshakeError(f"peer claims {metadata.num_blocks} blocks: out of range")
    return metadata


def fetch_peer_metadata(
    fetcher: MetadataFetcher | None,
    peer: PeerRef,
    *,
    connector: ConnectorName,
    local_layout: KVLayout,
) -> PeerMetadata:
    """Fetch the peer's envelope through the control channel and validate it. Raises
    ``MetadataUnavailableError`` when it could not be fetched, another ``HandshakeError``
    when it does not validate."""
    if fetcher is None:
        raise MetadataUnavailableError("this connector was built without fetch_peer_metadata")
    try:
        data = fetcher(peer.endpoint)
    except Exception as exc:
        raise MetadataUnavailableError(
            f"fetching metadata from {peer.endpoint!r} failed: {_one_line(exc)}"
        ) from exc
    return decode_peer_metadata(
        data, connector=connector, local_layout=local_layout, engine_id=peer.engine_id
    )


def decode_transport(data: bytes, kind: type[T]) -> T:
    """Decode the connector's own section of a validated envelope."""
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"undecodable {kind.__name__}: {exc}") from exc


def _one_line(exc: Exception) -> str:
    """A gRPC error as its code and details (its repr spans lines, and broke the
    line-per-record logs that quote it)."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return str(exc)
