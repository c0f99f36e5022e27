"""Typed errors of the KV-transfer layer.

Every ``KVTransferError`` means the same thing to a caller: *these blocks did not arrive*;
the engine may retry elsewhere or recompute the prompt. Subclasses say why, so that a
service can count them and map them to a status code in one place. Misuse of the API
(a duplicate transfer id, a block id out of range) raises ``ValueError`` instead: that is a
bug in the caller, not a transport failure.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """A transfer failed. The local destination blocks hold undefined data, and nothing
    writes them after the error is reported."""


class HandshakeError(KVTransferError):
    """The peer's metadata could not be fetched or decoded, or describes another connector
    or another engine than the one asked for (a stale endpoint)."""


class MetadataUnavailableError(HandshakeError):
    """The peer's metadata could not be fetched at all (no answer, or no way to ask): it
    may be gone, or the call failed once under load. Set apart from a peer that answered
    as another engine, which is surely not the one asked for."""


class LayoutMismatchError(HandshakeError):
    """The peer's KV layout differs from ours; nothing was transferred.

    ``mismatches`` maps each differing field to ``(ours, theirs)``.
    """

    def __init__(self, mismatches: dict[str, tuple[object, object]]) -> None:
        detail = ", ".join(f"{k}: ours={a!r} theirs={b!r}" for k, (a, b) in mismatches.items())
        super().__init__(f"KV layout mismatch ({detail})")
        self.mismatches = mismatches


class TransferTimeoutError(KVTransferError):
    """The transfer did not finish within the configured ``timeout_s``."""


class TransferFailedError(KVTransferError):
    """The transport reported an error: the peer died, a connection broke."""


class TransferRejectedError(KVTransferError):
    """The exporter does not hold this transfer (unknown or released lease) or was asked
    for blocks it did not export."""


class BlockNotFoundError(KVTransferError):
    """Shared storage: a block's file did not appear before the deadline."""


class CorruptBlockError(KVTransferError):
    """Shared storage: a block file failed its header or checksum check. Never used."""


class FetchAbortedError(KVTransferError):
    """The fetcher gave the transfer up (``abort_fetch``: its request was aborted)."""


class ConnectorClosedError(KVTransferError):
    """The connector was closed while the transfer was still running."""


class DuplicateTransferError(ValueError):
    """A transfer id is already active on this side."""

    def __init__(self, transfer_id: str) -> None:
        super().__init__(f"transfer {transfer_id!r} is already active")
        self.transfer_id = transfer_id
