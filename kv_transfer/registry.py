"""Connectors by name. Transports import lazily, so a process that uses shared storage
needs neither nixl nor pyzmq installed."""

from __future__ import annotations

from collections.abc import Callable

from kv_transfer.base import KVConnector
from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.handshake import MetadataFetcher


def _nixl() -> type[KVConnector]:
    try:
        from kv_transfer.nixl import NixlConnector
    except ImportError as exc:
        raise RuntimeError(f"kv_transfer.connector=nixl needs the nixl package: {exc}") from exc
    return NixlConnector


def _nccl() -> type[KVConnector]:
    try:
        from kv_transfer.nccl import NcclConnector
    except ImportError as exc:
        raise RuntimeError(f"kv_transfer.connector=nccl needs pyzmq: {exc}") from exc
    return NcclConnector


def _shared_storage() -> type[KVConnector]:
    from kv_transfer.shared_storage import SharedStorageConnector

    return SharedStorageConnector


_CONNECTORS: dict[ConnectorName, Callable[[], type[KVConnector]]] = {
    ConnectorName.NIXL: _nixl,
    ConnectorName.NCCL: _nccl,
    ConnectorName.SHARED_STORAGE: _shared_storage,
}


def create_connector(
    config: KVTransferConfig,
    engine_id: str,
    fetch_peer_metadata: MetadataFetcher | None = None,
) -> KVConnector:
    """Build the configured connector. ``engine_id`` must be unique per engine incarnation
    (peers cache handshakes by it); ``fetch_peer_metadata`` is needed to fetch, not to
    export."""
    return _CONNECTORS[config.connector]()(config, engine_id, fetch_peer_metadata)
