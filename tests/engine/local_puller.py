"""An in-process KV puller: copies blocks between two engines' caches in one process.

It honours the ``KVPuller`` contract (asynchronous: a pull completes at a later poll, and
can be made to fail) so engine tests can exercise the decode path without sockets; the
real transports are tested in tests/kv_transfer and through the services.
"""

from __future__ import annotations

from common.hashing import BlockHash
from engine.kv_connector import PullResults
from engine.llm_engine import LLMEngine
from engine.request import RemoteKV
from kernels import reference


class LocalPuller:
    def __init__(self) -> None:
        self.sources: dict[str, LLMEngine] = {}
        self.pending: list[tuple[str, RemoteKV, list[int], list[int]]] = []
        self.target: LLMEngine | None = None
        self.fail_next = False
        self.num_blocks_pulled = 0
        self.abandoned: list[str] = []  # transfer ids of remote KV never pulled

    def start_fetch(
        self,
        request_id: str,
        remote: RemoteKV,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        block_hashes: list[BlockHash],
    ) -> None:
        assert len(remote_block_ids) == len(local_block_ids) == len(block_hashes)
        self.pending.append((request_id, remote, remote_block_ids, local_block_ids))

    def abort_fetch(self, request_id: str) -> None:
        """Pulls here are copies at the next poll: nothing to stop early."""

    def abandon(self, remote: RemoteKV) -> None:
        self.abandoned.append(remote.transfer_id)

    def poll_fetches(self) -> PullResults:
        done, failed = [], {}
        assert self.target is not None
        for request_id, remote, remote_ids, local_ids in self.pending:
            if self.fail_next:
                failed[request_id] = "peer unreachable"
                self.fail_next = False
                continue
            source = self.sources[str(remote.source)]
            for src_cache, dst_cache in zip(
                source.runner.kv_caches, self.target.runner.kv_caches, strict=True
            ):
                staging = reference.gather_blocks(src_cache, _ids(remote_ids))
                reference.scatter_blocks(staging, dst_cache, _ids(local_ids))
            self.num_blocks_pulled += len(remote_ids)
            done.append(request_id)
        self.pending = []
        return PullResults(done, failed)


def _ids(block_ids: list[int]):
    import torch

    return torch.tensor(block_ids, dtype=torch.long)
