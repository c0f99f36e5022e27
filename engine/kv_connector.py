"""What the engine needs from a KV connector to pull a prompt's KV from another worker.

The engine orders pulls when it admits a request with ``remote_kv`` and polls for their
end once per step; it never blocks on a transfer. A pull writes into local blocks the
engine has allocated and keeps reserved until the pull is reported done or failed, even
if the request is aborted meanwhile, so a late write can never land in reused blocks. A
pull reported failed *late* (a transport write it cannot cancel may still land: a NIXL
READ from a frozen peer) fails its request at once, but the engine keeps its blocks out
of use (quarantined, under its transfer id) until the puller reports that transfer
released. ``kv_transfer`` adapts each transport to this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from common.hashing import BlockHash
from engine.request import RemoteKV


@dataclass(slots=True)
class PullResults:
    """What ``KVPuller.poll_fetches`` returns. ``late`` names the failed pulls whose blocks
    may still be written; each one's transfer id comes back once in ``released`` of this
    or a later poll, when nothing writes them any more. Transfer ids, not request ids:
    the request has moved on (recomputes, or finished) by then."""

    done: list[str] = field(default_factory=list)  # request ids
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason
    late: set[str] = field(default_factory=set)  # request ids, among ``failed``
    released: list[str] = field(default_factory=list)  # transfer ids of late pulls


class KVPuller(Protocol):
    def start_fetch(
        self,
        request_id: str,
        remote: RemoteKV,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        block_hashes: list[BlockHash],
    ) -> None:
        """Begin pulling; must not block. ``block_hashes[i]`` names the pulled block i
        (``common.hashing.transfer_block_hashes``: partial blocks have names too)."""
        ...

    def abort_fetch(self, request_id: str) -> None:
        """The request was aborted: stop the pull early if the transport safely can. It is
        still reported by ``poll_fetches`` (done or failed), and its blocks stay reserved
        until then. A no-op for an unknown id."""
        ...

    def abandon(self, remote: RemoteKV) -> None:
        """Nothing here will read ``remote``'s blocks, and no transfer will tell the peer
        so: the request was aborted (or left) before its pull started, its handle was
        refused, or every block was cached here. The peer may free them now rather than
        when its lease expires; a caller that leaves once the engine holds the request
        (``proto.ADMITTED_KEY``) counts on it. A pull that ran is the transport's to
        report. Must not block; best effort."""
        ...

    def poll_fetches(self) -> PullResults:
        """Pulls that ended since the last poll, and late ones released since."""
        ...
