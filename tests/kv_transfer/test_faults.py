"""Fault injection between real processes: a peer SIGKILLed mid-transfer, corrupted files.

The contract under test (kv_transfer/base.py): every fetch settles within ``timeout_s``,
with a typed error or with bit-exact data, never a hang and never wrong bytes; and the
surviving side keeps working.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kv_transfer.blockfile import read_block_file
from kv_transfer.layout import KVLayout
from tests.kv_transfer.harness import start_peers
from tests.kv_transfer.links import (
    Link,
    add_fetcher,
    connector_config,
    open_link,
    random_hashes,
)

# Big enough that the transfers are still running when the kill lands.
BIG_LAYOUT = {
    "num_layers": 4,
    "num_blocks": 256,
    "block_size": 16,
    "num_kv_heads": 8,
    "head_dim": 64,
    "dtype": "bfloat16",
}  # 128 KiB per block, 32 MiB per cache
TIMEOUT_S = 3.0
SLACK_S = 3.0  # scheduling noise on a loaded 2-core CI box
TRANSFER_ERRORS = {
    "TransferFailedError",
    "TransferTimeoutError",
    "HandshakeError",
    "BlockNotFoundError",
}


@pytest.fixture(scope="module")
def peers():
    exporter, fetcher = start_peers("exporter", "fetcher")
    yield exporter, fetcher
    exporter.close()
    fetcher.close()


def plan_transfers(prefix: str, count: int, blocks_each: int, seed: str):
    """``count`` transfers of distinct random blocks on both sides."""
    rng = random.Random(seed)
    remote_pool = rng.sample(range(BIG_LAYOUT["num_blocks"]), BIG_LAYOUT["num_blocks"])
    local_pool = rng.sample(range(BIG_LAYOUT["num_blocks"]), BIG_LAYOUT["num_blocks"])
    return {
        f"{prefix}{i}": (
            [remote_pool.pop() for _ in range(blocks_each)],
            [local_pool.pop() for _ in range(blocks_each)],
            random_hashes(blocks_each, BIG_LAYOUT["block_size"], rng),
        )
        for i in range(count)
    }


def check_healthy_transfer(link: Link, tid: str) -> None:
    remote, local = [7, 8, 9, 100], [200, 201, 202, 3]
    hashes = random_hashes(4, BIG_LAYOUT["block_size"], random.Random(tid))
    link.export(tid, remote, hashes)
    link.fetch(tid, remote, local, hashes)
    result = link.wait([tid], wait_s=TIMEOUT_S + 10)[tid]
    assert result["ok"], result
    assert link.dest_digests(local) == link.source_digests(remote)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("connector", ["nixl", "nixl_split", "nccl", "shared_storage"])
def test_exporter_killed_mid_transfer(peers, connector, tmp_path):
    exporter, fetcher = peers
    (victim,) = start_peers("victim-exporter")
    try:
        doomed = open_link(
            victim, fetcher, connector, tmp_path, timeout_s=TIMEOUT_S, layout=BIG_LAYOUT
        )
        transfers = plan_transfers("doomed", 8, 30, f"kill-exporter-{connector}")
        warm_up = transfers.pop("doomed0")  # connects first, so the kill hits a live link
        last = transfers.pop("doomed7")  # started only after the kill: must fail
        sources = {tid: doomed.source_digests(remote) for tid, (remote, _, _) in transfers.items()}
        for tid, (remote, _, hashes) in {"doomed0": warm_up, **transfers}.items():
            doomed.export(tid, remote, hashes)
        doomed.fetch("doomed0", *warm_up)
        assert doomed.wait(["doomed0"], wait_s=TIMEOUT_S + 10)["doomed0"]["ok"]
        for tid, (remote, local, hashes) in transfers.items():
            doomed.fetch(tid, remote, local, hashes)
        victim.kill()  # lands while those are queued, moving or done: any mix is legal
        doomed.fetch("doomed7", *last)
        results = doomed.wait([*transfers, "doomed7"], wait_s=TIMEOUT_S + 20)

        for tid, result in results.items():
            assert result["elapsed_s"] < TIMEOUT_S + SLACK_S, (tid, result)
            if result["ok"]:  # finished before the kill landed: must then be exact
                assert doomed.dest_digests(transfers[tid][1]) == sources[tid], tid
            else:
                assert result["error_type"] in TRANSFER_ERRORS, (tid, result)
        assert not results["doomed7"]["ok"]
        assert fetcher.call("counts", slot=doomed.dst)["fetches"] == 0
        if connector == "shared_storage":
            assert_no_torn_files(tmp_path, BIG_LAYOUT)
        # The fetcher keeps working with a live exporter.
        healthy = open_link(exporter, fetcher, connector, tmp_path, layout=BIG_LAYOUT)
        check_healthy_transfer(healthy, f"after-kill-{connector}")
        healthy.close()
    finally:
        victim.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("connector", ["nixl", "nccl"])
def test_fetcher_killed_mid_transfer(peers, connector, tmp_path):
    exporter, fetcher = peers
    (victim,) = start_peers("victim-fetcher")
    try:
        doomed = open_link(
            exporter, victim, connector, tmp_path, timeout_s=TIMEOUT_S, layout=BIG_LAYOUT
        )
        transfers = plan_transfers("orphan", 6, 32, f"kill-fetcher-{connector}")
        for tid, (remote, _, hashes) in transfers.items():
            doomed.export(tid, remote, hashes)
        for tid, (remote, local, hashes) in transfers.items():
            doomed.fetch(tid, remote, local, hashes)
        victim.kill()

        # The exporter serves another fetcher from the same slot meanwhile.
        healthy = add_fetcher(doomed, fetcher, connector_config(connector, tmp_path, TIMEOUT_S))
        check_healthy_transfer(healthy, f"healthy-{connector}")

        # Orphaned exports are the lease's business: releasing them leaves nothing behind.
        for tid in transfers:
            exporter.call("release_export", slot=doomed.src, transfer_id=tid)
        healthy.finished_exports(expect=[f"healthy-{connector}"])
        assert exporter.call("counts", slot=doomed.src)["exports"] == 0
        healthy.close()
    finally:
        victim.close()


@pytest.mark.timeout(60)
def test_corrupted_shared_storage_file_is_detected(peers, tmp_path):
    link = open_link(*peers, "shared_storage", tmp_path, timeout_s=2.0, layout=BIG_LAYOUT)
    remote = [11, 12, 13, 14]
    hashes = random_hashes(4, BIG_LAYOUT["block_size"], random.Random("corrupt"))
    link.export("stored", remote, hashes)
    assert "stored" in link.finished_exports(expect=["stored"])
    paths = [next(tmp_path.rglob(f"{h}.kvblock")) for h in hashes]  # under <ns>/<layout>/
    flip_byte(paths[0], -100)  # payload
    flip_byte(paths[1], 20)  # header
    paths[2].write_bytes(paths[2].read_bytes()[:-1])  # truncated

    for i, local in enumerate([40, 41, 42]):
        before = link.dest_digests([local])
        tid = f"corrupt{i}"
        link.fetch(tid, [remote[i]], [local], [hashes[i]])
        result = link.wait([tid], wait_s=10)[tid]
        assert not result["ok"] and result["error_type"] == "CorruptBlockError", result
        assert link.dest_digests([local]) == before
    link.fetch("intact", [remote[3]], [43], [hashes[3]])
    assert link.wait(["intact"], wait_s=10)["intact"]["ok"]
    assert link.dest_digests([43]) == link.source_digests([remote[3]])
    link.close()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def assert_no_torn_files(shared_dir: Path, layout: dict) -> None:
    """Every file under a final name is whole (writes are temp file + rename)."""
    kv_layout = KVLayout(**{k: v for k, v in layout.items() if k != "num_blocks"})
    for path in shared_dir.rglob("*.kvblock"):
        out = bytearray(kv_layout.block_bytes)
        read_block_file(path, kv_layout, bytes.fromhex(path.stem), memoryview(out))
