"""Every transport between two real processes on 127.0.0.1: bit-exact transfers, several at
once, layout mismatch, unknown transfers. Fault injection (killed peers) is in
``test_faults.py``."""

from __future__ import annotations

import random

import pytest

from tests.kv_transfer.harness import SMALL_LAYOUT, start_peers
from tests.kv_transfer.links import open_link, random_hashes

CONNECTORS = ["nixl", "nixl_split", "nccl", "shared_storage"]
NUM_BLOCKS = SMALL_LAYOUT["num_blocks"]
BLOCK_SIZE = SMALL_LAYOUT["block_size"]


@pytest.fixture(scope="module")
def peers():
    exporter, fetcher = start_peers("exporter", "fetcher")
    yield exporter, fetcher
    exporter.close()
    fetcher.close()


# How each side's caches are arranged (exporter, fetcher): the engine's block-major views of
# one buffer, or a tensor per layer (layout.py). Only NIXL addresses the memory itself, so
# it alone also runs the mixed pairs.
ARRANGEMENTS = {
    "block_major": (True, True),
    "separate": (False, False),
    "exporter_block_major": (True, False),
    "fetcher_block_major": (False, True),
}
CASES = [(connector, "block_major") for connector in CONNECTORS] + [
    (connector, "separate") for connector in CONNECTORS
]
CASES += [("nixl", "exporter_block_major"), ("nixl_split", "fetcher_block_major")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("connector", "arrangement"), CASES)
def test_concurrent_random_subsets_arrive_bit_exact(peers, connector, arrangement, tmp_path):
    exporter_block_major, fetcher_block_major = ARRANGEMENTS[arrangement]
    link = open_link(
        *peers,
        connector,
        tmp_path,
        layout={**SMALL_LAYOUT, "block_major": fetcher_block_major},
        exporter_layout={**SMALL_LAYOUT, "block_major": exporter_block_major},
    )
    rng = random.Random(f"subsets-{connector}-{arrangement}")
    free_local = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    transfers = {}
    for i in range(5):
        n = 0 if i == 0 else rng.randint(1, 10)  # an empty transfer too: all blocks cached
        remote = rng.sample(range(NUM_BLOCKS), n)
        local = [free_local.pop() for _ in range(n)]
        hashes = random_hashes(n, BLOCK_SIZE, rng)
        transfers[f"t{i}-{connector}-{arrangement}"] = (remote, local, hashes)
    untouched = sorted(free_local)
    untouched_before = link.dest_digests(untouched)

    for tid, (remote, _, hashes) in transfers.items():
        link.export(tid, remote, hashes)
    for tid, (remote, local, hashes) in transfers.items():  # all in flight at once
        link.fetch(tid, remote, local, hashes)
    results = link.wait(list(transfers), wait_s=30)

    for tid, (remote, local, _) in transfers.items():
        assert results[tid]["ok"], results[tid]
        assert link.dest_digests(local) == link.source_digests(remote), tid
    assert link.dest_digests(untouched) == untouched_before, "a block outside the fetch changed"
    assert set(link.finished_exports(expect=list(transfers))) >= set(transfers)
    exporter_counts, fetcher_counts = link.counts()
    assert exporter_counts["exports"] == 0 and fetcher_counts["fetches"] == 0, "leaked"
    link.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("connector", ["nixl", "nccl", "shared_storage"])
def test_fp8_caches_arrive_bit_exact(peers, connector, tmp_path):
    """``engine.kv_cache_dtype: fp8``: caches of one-byte floats arrive bit for bit (torch
    has no CPU index_copy_ for them, so scatters move their bytes)."""
    layout = {**SMALL_LAYOUT, "dtype": "float8_e4m3fn", "block_major": True}
    link = open_link(*peers, connector, tmp_path, layout=layout, exporter_layout=layout)
    rng = random.Random(f"fp8-{connector}")
    remote, local = [3, 9, 1, 60], [5, 6, 40, 0]
    hashes = random_hashes(len(remote), BLOCK_SIZE, rng)
    link.export("fp8", remote, hashes)
    link.fetch("fp8", remote, local, hashes)
    result = link.wait(["fp8"], wait_s=30)["fp8"]
    assert result["ok"], result
    assert link.dest_digests(local) == link.source_digests(remote)
    link.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("connector", CONNECTORS)
def test_layout_mismatch_is_rejected_and_nothing_is_written(peers, connector, tmp_path):
    # Same bytes per block, other dtype: a byte-level copy would "work" and be garbage.
    other = {**SMALL_LAYOUT, "dtype": "float16"}
    link = open_link(*peers, connector, tmp_path, exporter_layout=other)
    rng = random.Random(f"mismatch-{connector}")
    remote, local = [1, 2, 3], [10, 11, 12]
    hashes = random_hashes(3, BLOCK_SIZE, rng)
    before = link.dest_digests(local)

    link.export("mismatch", remote, hashes)
    if connector == "shared_storage":  # the mismatch shows in the files' headers
        link.finished_exports(expect=["mismatch"])
    link.fetch("mismatch", remote, local, hashes)
    result = link.wait(["mismatch"], wait_s=20)["mismatch"]

    assert not result["ok"]
    assert result["error_type"] == "LayoutMismatchError", result
    assert "dtype" in result["error"]
    assert link.dest_digests(local) == before
    assert link.counts()[1]["fetches"] == 0
    link.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("connector", "error_type"),
    [("nccl", "TransferRejectedError"), ("shared_storage", "BlockNotFoundError")],
)
def test_fetching_what_was_never_exported_fails_typed(peers, connector, error_type, tmp_path):
    # NIXL reads one-sidedly and cannot know; the lease contract (base.py) covers it.
    timeout_s = 1.0
    link = open_link(*peers, connector, tmp_path, timeout_s=timeout_s)
    hashes = random_hashes(2, BLOCK_SIZE, random.Random(connector))
    link.fetch("never-exported", [4, 5], [6, 7], hashes)
    result = link.wait(["never-exported"], wait_s=timeout_s + 10)["never-exported"]
    assert not result["ok"] and result["error_type"] == error_type, result
    assert result["elapsed_s"] < timeout_s + 2

    # The same link still works afterwards.
    link.export("after", [4, 5], hashes)
    link.fetch("after", [4, 5], [6, 7], hashes)
    assert link.wait(["after"], wait_s=10)["after"]["ok"]
    assert link.dest_digests([6, 7]) == link.source_digests([4, 5])
    link.close()
