"""A connector slot in an exporting peer wired to one in a fetching peer, with the few
operations the tests need, in test vocabulary."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.hashing import hash_blocks
from tests.kv_transfer.harness import SMALL_LAYOUT, PeerProcess


def connector_config(connector: str, shared_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Settings per connector name; ``nixl_split`` is NIXL with every fetch split over
    three read lanes, however small, so that the tests' fetches exercise the split."""
    if connector == "nixl_split":
        return {
            "connector": "nixl",
            "timeout_s": timeout_s,
            "nixl_read_lanes": 3,
            "nixl_lane_min_bytes": 0,
        }
    config: dict[str, Any] = {"connector": connector, "timeout_s": timeout_s}
    if connector == "nccl":
        config["staging_bytes"] = 2048  # several layer groups even for small transfers
    if connector == "shared_storage":
        config["shared_dir"] = str(shared_dir)
    return config


def random_hashes(num_blocks: int, block_size: int, rng: random.Random) -> list[str]:
    """Real chained block hashes of random tokens, under a fresh salt (no collisions)."""
    tokens = [rng.randrange(50_000) for _ in range(num_blocks * block_size)]
    salt = f"{rng.random()}"
    return [h.hex() for h in hash_blocks(tokens, block_size, salt=salt)]


@dataclass
class Link:
    exporter: PeerProcess
    fetcher: PeerProcess
    src: str  # slot names
    dst: str
    engine_id: str  # the exporter's
    endpoint: str
    layout: dict[str, Any]

    def export(self, tid: str, block_ids: list[int], hashes: list[str]) -> None:
        self.exporter.call(
            "export", slot=self.src, transfer_id=tid, block_ids=block_ids, block_hashes=hashes
        )

    def fetch(self, tid: str, remote: list[int], local: list[int], hashes: list[str]) -> None:
        self.fetcher.call(
            "fetch",
            slot=self.dst,
            transfer_id=tid,
            engine_id=self.engine_id,
            endpoint=self.endpoint,
            remote_block_ids=remote,
            local_block_ids=local,
            block_hashes=hashes,
        )

    def wait(self, tids: list[str], wait_s: float) -> dict[str, dict[str, Any]]:
        """Each fetch's outcome: ok, error_type, error, elapsed_s since its start."""
        reply = self.fetcher.call(
            "wait", timeout_s=wait_s + 30, slot=self.dst, transfer_ids=tids, wait_s=wait_s
        )
        return reply["results"]

    def source_digests(self, block_ids: list[int]) -> list[str]:
        return self.exporter.call("digests", slot=self.src, block_ids=block_ids)["digests"]

    def dest_digests(self, block_ids: list[int]) -> list[str]:
        return self.fetcher.call("digests", slot=self.dst, block_ids=block_ids)["digests"]

    def finished_exports(self, expect: list[str], wait_s: float = 10.0) -> list[str]:
        """Exports reported finished so far, once ``expect`` are all in (or after wait_s)."""
        reply = self.exporter.call(
            "finished_exports", timeout_s=wait_s + 30, slot=self.src, expect=expect, wait_s=wait_s
        )
        return reply["finished"]

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        src = self.exporter.call("counts", slot=self.src)
        dst = self.fetcher.call("counts", slot=self.dst)
        return src, dst

    def close(self) -> None:
        for peer, slot in ((self.exporter, self.src), (self.fetcher, self.dst)):
            if peer.process.poll() is None:
                peer.call("close", slot=slot)


def open_link(
    exporter: PeerProcess,
    fetcher: PeerProcess,
    connector: str,
    shared_dir: Path,
    *,
    timeout_s: float = 10.0,
    layout: dict[str, Any] = SMALL_LAYOUT,
    exporter_layout: dict[str, Any] | None = None,
) -> Link:
    """Create a slot on each side (random caches, different seeds) and wire them."""
    name = f"{connector}-{uuid.uuid4().hex[:8]}"
    config = connector_config(connector, shared_dir, timeout_s)
    exporter.call(
        "create",
        slot=f"src-{name}",
        engine_id=f"exporter-{name}",
        config=config,
        layout=exporter_layout or layout,
        seed=1,
    )
    link = Link(exporter, fetcher, f"src-{name}", "", f"exporter-{name}", "", layout)
    return add_fetcher(link, fetcher, config)


def add_fetcher(link: Link, fetcher: PeerProcess, config: dict[str, Any]) -> Link:
    """A new fetching slot on ``fetcher``, wired to ``link``'s exporting slot."""
    name = uuid.uuid4().hex[:8]
    metadata = link.exporter.call("metadata", slot=link.src)["metadata"]
    dst = f"dst-{name}"
    fetcher.call(
        "create", slot=dst, engine_id=f"fetcher-{name}", config=config, layout=link.layout, seed=2
    )
    endpoint = f"grpc://{link.engine_id}"
    fetcher.call("add_peer", endpoint=endpoint, metadata=metadata)
    return Link(link.exporter, fetcher, link.src, dst, link.engine_id, endpoint, link.layout)
