"""The tensor-parallel relay reports a fetch late when any rank failed it late, and
released only once every such rank has released it: until then that rank's READ may
still write its blocks. Rank 0's connector is real (shared storage); rank 1 speaks
through a stand-in for the shard channel (``ShardClient``'s two calls the relay uses)."""

from __future__ import annotations

import time
from typing import Any

import torch

from kv_transfer import KVConnector, KVTransferConfig, PeerRef, create_connector
from worker.tp_connector import FetchesSettled, TensorParallelConnector


class ShardChannel:
    """Rank 1's end: records what rank 0 sends, returns the replies queued for it."""

    size = 2

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.replies: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def extension_replies(self) -> list[Any]:
        replies, self.replies = self.replies, []
        return replies


def poll_until(relay: TensorParallelConnector, wait_s: float = 10.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        results = relay.poll_fetches()
        if results:
            return results
        time.sleep(0.01)
    raise AssertionError("nothing settled")


def relay_over_shared_storage(tmp_path) -> tuple[KVConnector, TensorParallelConnector,
                                                   ShardChannel]:  # fmt: skip
    """Rank 0's real connector (its fetches wait for files that never come), the relay."""
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              timeout_s=30.0)  # fmt: skip
    local = create_connector(config, "decode")
    local.register_kv_caches([torch.zeros(8, 2, 4, 2, 16) for _ in range(2)])
    relay, shard = TensorParallelConnector(local, 2), ShardChannel()
    relay.attach(shard, [b""])
    return local, relay, shard


def test_a_fetch_failed_late_on_one_rank_is_released_once_that_rank_releases_it(tmp_path):
    local, relay, shard = relay_over_shared_storage(tmp_path)
    with local:
        relay.start_fetch("t", PeerRef("prefill", ""), [1, 2], [3, 4], [bytes(32), bytes(32)])
        relay.abort_fetch("t")  # rank 0 gives it up (its files never come): not late
        shard.replies.append(FetchesSettled(1, [], {"t": "TransferTimeoutError: late"}, ["t"]))
        results = poll_until(relay)
        assert list(results.failed) == ["t"] and results.late == {"t"}
        assert relay.num_active_fetches == 0 and relay.num_late_fetches == 1
        assert not relay.poll_fetches()  # rank 1's READ may still write: not released

        shard.replies.append(FetchesSettled(1, [], {}, released=["t"]))
        results = relay.poll_fetches()
        assert results.released == ["t"] and not results.failed and not results.late
        assert relay.num_late_fetches == 0


def test_a_rank_that_released_before_the_fetch_settled_everywhere_is_not_late(tmp_path):
    """Rank 1 failed it late and released it while rank 0 still ran it: failed, not late."""
    local, relay, shard = relay_over_shared_storage(tmp_path)
    with local:
        relay.start_fetch("t", PeerRef("prefill", ""), [1, 2], [3, 4], [bytes(32), bytes(32)])
        shard.replies += [FetchesSettled(1, [], {"t": "TransferTimeoutError: late"}, ["t"]),
                          FetchesSettled(1, [], {}, released=["t"])]  # fmt: skip
        assert not relay.poll_fetches()  # rank 0 still runs it
        relay.abort_fetch("t")
        results = poll_until(relay)
        assert list(results.failed) == ["t"] and not results.late and not results.released
        assert relay.num_late_fetches == 0
