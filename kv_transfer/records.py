"""Plain records that cross the connector API and its threads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kv_transfer.errors import KVTransferError


@dataclass(frozen=True, slots=True)
class PeerRef:
    """Where a fetch pulls from: the exporter's engine id and how to reach its metadata."""

    engine_id: str  # the exporter's engine id, as in its metadata
    endpoint: str  # passed to fetch_peer_metadata; opaque to the connector


@dataclass(frozen=True, slots=True)
class FetchRecord:
    transfer_id: str
    peer: PeerRef
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...] | None
    deadline: float  # time.monotonic() after which the fetch fails

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True, slots=True)
class ExportRecord:
    transfer_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...] | None


@dataclass(slots=True)
class FetchResults:
    """What ``poll_fetches`` returns: transfers that landed, transfers that failed, and
    for late ones (failed while a write into their local blocks may still run: a NIXL
    READ UCX cannot cancel) when that write has ended.

    ``late`` is a subset of ``failed``'s ids: their local blocks must stay out of use
    until the id comes back in ``released`` of a later poll (each exactly once)."""

    done: list[str] = field(default_factory=list)
    failed: dict[str, KVTransferError] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)
    released: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.done or self.failed or self.released)
