"""Adapts a ``kv_transfer.KVConnector`` to the engine's ``KVPuller`` seam.

The engine names pulls by request id, connectors by transfer id (the prefill worker's
lease id); this keeps the mapping. Called only from the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable

from common.hashing import BlockHash
from engine.kv_connector import PullResults
from engine.request import RemoteKV
from kv_transfer import KVConnector, PeerRef


class ConnectorPuller:
    def __init__(
        self, connector: KVConnector, release_remote: Callable[[str, str], None] | None = None
    ) -> None:
        """``release_remote(endpoint, lease_id)``: ask the prefill worker at ``endpoint``
        to free a lease no pull will read (``abandon``); must not block."""
        self.connector = connector
        self.release_remote = release_remote
        self._request_of: dict[str, str] = {}  # transfer id → request id
        self._refused: dict[str, str] = {}  # request id → why start_fetch refused it
        self.num_blocks_pulled = 0

    def start_fetch(
        self,
        request_id: str,
        remote: RemoteKV,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        block_hashes: list[BlockHash],
    ) -> None:
        assert isinstance(remote.source, PeerRef)
        try:
            self.connector.start_fetch(
                remote.transfer_id, remote.source, remote_block_ids, local_block_ids, block_hashes
            )
        except (ValueError, RuntimeError) as exc:  # refused up front: report at next poll
            self._refused[request_id] = f"{type(exc).__name__}: {exc}"
            return
        self._request_of[remote.transfer_id] = request_id
        self.num_blocks_pulled += len(remote_block_ids)

    def abort_fetch(self, request_id: str) -> None:
        for transfer_id, owner in self._request_of.items():
            if owner == request_id:
                self.connector.abort_fetch(transfer_id)
                return

    def abandon(self, remote: RemoteKV) -> None:
        assert isinstance(remote.source, PeerRef)
        if self.release_remote is not None:
            self.release_remote(remote.source.endpoint, remote.transfer_id)

    def poll_fetches(self) -> PullResults:
        results = self.connector.poll_fetches()
        pulls = PullResults(released=results.released)
        pulls.done = [self._request_of.pop(t) for t in results.done if t in self._request_of]
        for transfer_id, error in results.failed.items():
            request_id = self._request_of.pop(transfer_id, None)
            if request_id is None:
                continue
            pulls.failed[request_id] = f"{type(error).__name__}: {error}"
            if transfer_id in results.late:
                pulls.late.add(request_id)
        pulls.failed.update(self._refused)
        self._refused.clear()
        return pulls
