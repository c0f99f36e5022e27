"""Move KV blocks between engines: one connector interface, several transports.

See ``base.py`` for the contract, ``config.py`` for settings, ``registry.py`` to build one.
"""

from kv_transfer.base import KVConnector
from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.errors import (
    BlockNotFoundError,
    ConnectorClosedError,
    CorruptBlockError,
    DuplicateTransferError,
    FetchAbortedError,
    HandshakeError,
    KVTransferError,
    LayoutMismatchError,
    TransferFailedError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kv_transfer.handshake import MetadataFetcher
from kv_transfer.layout import KVLayout
from kv_transfer.records import FetchResults, PeerRef
from kv_transfer.registry import create_connector

__all__ = [
    "BlockNotFoundError",
    "ConnectorClosedError",
    "ConnectorName",
    "CorruptBlockError",
    "DuplicateTransferError",
    "FetchAbortedError",
    "FetchResults",
    "HandshakeError",
    "KVConnector",
    "KVLayout",
    "KVTransferConfig",
    "KVTransferError",
    "LayoutMismatchError",
    "MetadataFetcher",
    "PeerRef",
    "TransferFailedError",
    "TransferRejectedError",
    "TransferTimeoutError",
    "create_connector",
]
