"""What the engine needs from a KV connector to pull a prompt's KV from another worker.

The engine orders pulls when it admits a request with ``remote_kv`` and polls for their
end once per step; it never blocks on a transfer. A pull writes into local blocks the
engine has allocated and keeps reserved until the pull is reported done or failed, even
if the request is aborted meanwhile, so a late write can never land in reused blocks.
``kv_transfer`` adapts each transport to this protocol.
"""

from __future__ import annotations

from typing import Protocol

from common.hashing import BlockHash
from engine.request import RemoteKV


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

    def poll_fetches(self) -> tuple[list[str], dict[str, str]]:
        """Pulls that ended since the last poll: (done request ids, failed id → reason)."""
        ...
