"""A pull that failed never writes its local blocks afterwards.

The decode worker frees a failed pull's blocks and hands them to other requests (or
recomputes the prompt into them), so a READ that outlived its fetch's failure would
overwrite someone else's KV when the frozen prefill worker resumes. The exporter here is a
process SIGSTOPped between a warm-up fetch and the doomed one. The doomed fetch fails at
its deadline, the exporter still frozen; NIXL reports it late (its READ may still land),
and the blocks may be reused only once it is released. Then they get a known pattern,
the exporter is resumed (if it was not already), more fetches from it drive the
fetcher's transport (a late answer lands only when the fetcher progresses it), and the
pattern must survive.

NIXL runs over UCX's TCP transport, as between hosts without RDMA: a READ is a request the
exporter answers, and UCX cannot cancel one. NIXL reported such a READ failed at its
deadline, after releasing its handle, and the answer landed later: the bug this caught.
A fix held the fetch (and its request) until the READ ended; it now fails at the deadline
as late, and comes back released once the READ has ended (``kv_transfer/nixl_lane.py``;
the engine quarantines the blocks meanwhile: ``tests/worker/test_late_pull_quarantine.py``).
NCCL (gloo here) receives into staging buffers and scatters them in the fetch thread
before the fetch settles, after tearing the pair's group down on a failure; shared
storage reads files synchronously, also before the fetch settles: both were safe already.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
import torch

from kv_transfer import KVConnector, KVTransferConfig, PeerRef, create_connector
from kv_transfer.errors import KVTransferError
from tests.kv_transfer.harness import SMALL_LAYOUT, PeerProcess, start_peers
from tests.kv_transfer.links import connector_config, random_hashes
from tests.kv_transfer.peer import block_digest

TIMEOUT_S = 2.0
NUM_BLOCKS = SMALL_LAYOUT["num_blocks"]
BLOCK_SHAPE = (
    NUM_BLOCKS,
    2,
    SMALL_LAYOUT["block_size"],
    SMALL_LAYOUT["num_kv_heads"],
    SMALL_LAYOUT["head_dim"],
)
PATTERN = 0x1234  # int16 bits of every element of a reused block


def zero_caches() -> list[torch.Tensor]:
    return [
        torch.zeros(BLOCK_SHAPE, dtype=torch.bfloat16) for _ in range(SMALL_LAYOUT["num_layers"])
    ]


def reuse(caches: list[torch.Tensor], block_ids: list[int]) -> list[str]:
    """Write the pattern into ``block_ids`` (another request's KV); their digests."""
    for layer in caches:
        layer.view(torch.int16)[block_ids] = PATTERN
    return [block_digest(caches, b) for b in block_ids]


def released(connector: KVConnector, transfer_id: str, wait_s: float) -> bool:
    """True once a late fetch comes back released, False if not within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        results = connector.poll_fetches()
        assert not results.done and not results.failed, results
        if transfer_id in results.released:
            return True
        time.sleep(0.01)
    return False


def settles_failed(connector: KVConnector, transfer_id: str, wait_s: float) -> bool:
    """True once the fetch is reported failed, False if it is still running after
    ``wait_s``; a fetch from a frozen exporter must not be reported done."""
    try:
        connector.wait(transfer_id, timeout_s=wait_s)
    except KVTransferError:
        return True
    except TimeoutError:
        return False
    raise AssertionError(f"{transfer_id} landed from a frozen exporter")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["nixl", "nixl_split", "nccl"])
def test_a_timed_out_pull_does_not_write_its_blocks_after_the_peer_resumes(
    connector, tmp_path, monkeypatch
):
    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: the exporter inherits it
    config = connector_config(connector, tmp_path, TIMEOUT_S)
    (exporter,) = start_peers("frozen-exporter")
    layout = {**SMALL_LAYOUT, "block_major": False}
    metadata = exporter.call(
        "create", slot="src", engine_id="frozen", config=config, layout=layout, seed=1
    )["metadata"]
    known = {"frozen": bytes.fromhex(metadata)}
    dest = zero_caches()
    fetcher = create_connector(KVTransferConfig(**config), "fetcher", known.__getitem__)
    peer = PeerRef("frozen", "frozen")
    rng = random.Random(connector)
    remote_ids = rng.sample(range(NUM_BLOCKS), 24)
    local_ids = rng.sample(range(NUM_BLOCKS), 24)
    doomed, later = local_ids[:16], local_ids[16:]
    frozen = False

    def pull(tid: str, remote: list[int], local: list[int]) -> None:
        exporter.call("export", slot="src", transfer_id=tid, block_ids=remote, block_hashes=None)
        fetcher.start_fetch(tid, peer, remote, local)

    try:
        fetcher.register_kv_caches(dest)
        pull("warm-up", remote_ids[16:17], later[:1])  # connected before the freeze
        fetcher.wait("warm-up", timeout_s=TIMEOUT_S + 10)

        exporter.call("export", slot="src", transfer_id="doomed", block_ids=remote_ids[:16],
                      block_hashes=None)  # fmt: skip
        exporter.process.send_signal(signal.SIGSTOP)
        frozen = True
        started = time.monotonic()
        fetcher.start_fetch("doomed", peer, remote_ids[:16], doomed)
        # Fails at its deadline, the exporter still frozen (it was held until the resume).
        assert settles_failed(fetcher, "doomed", TIMEOUT_S + 1)
        assert time.monotonic() - started < TIMEOUT_S + 1
        if connector.startswith("nixl"):  # its READ may still land: quarantined
            assert fetcher.num_late_reads_running >= 1 and fetcher.num_late_fetches == 1
            assert not released(fetcher, "doomed", 0.5), "released while the READ runs"
            exporter.process.send_signal(signal.SIGCONT)
            frozen = False
            assert released(fetcher, "doomed", 10.0), "not released after the resume"
        assert fetcher.num_late_fetches == 0
        reused = reuse(dest, doomed)  # the engine freed them: another request's KV now

        if frozen:
            exporter.process.send_signal(signal.SIGCONT)
            frozen = False
        time.sleep(0.5)  # the exporter answers the doomed READ
        for i, (remote, local) in enumerate(zip(remote_ids[17:], later[1:], strict=True)):
            pull(f"after-{i}", [remote], [local])  # progress every lane
            fetcher.wait(f"after-{i}", timeout_s=TIMEOUT_S + 10)
        time.sleep(0.2)

        assert [block_digest(dest, b) for b in doomed] == reused
        source = exporter.call("digests", slot="src", block_ids=remote_ids[17:])["digests"]
        assert [block_digest(dest, b) for b in later[1:]] == source
        assert fetcher.num_active_fetches == 0
        if connector.startswith("nixl"):
            assert fetcher.num_late_reads_running == 0
    finally:
        if frozen:
            exporter.process.send_signal(signal.SIGCONT)
        fetcher.close()
        exporter.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["nixl", "nixl_split"])
def test_a_pull_from_a_peer_replaced_behind_its_address_does_not_write_its_blocks_later(
    connector, tmp_path, monkeypatch
):
    """The frozen exporter's address answers as another engine now (it was replaced), so
    the fetcher forgets the frozen one while a READ from it runs, well before its deadline.
    That fetch fails, and must not write its blocks afterwards either."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    config = connector_config(connector, tmp_path, 5 * TIMEOUT_S)
    old, new = start_peers("frozen-exporter", "replacement")
    layout = {**SMALL_LAYOUT, "block_major": False}
    known: dict[str, bytes] = {}
    for exporter, engine_id in ((old, "old"), (new, "new")):
        reply = exporter.call(
            "create", slot="src", engine_id=engine_id, config=config, layout=layout, seed=1
        )
        known[engine_id] = bytes.fromhex(reply["metadata"])
    address = {"addr": known["old"]}
    dest = zero_caches()
    fetcher = create_connector(KVTransferConfig(**config), "fetcher", address.__getitem__)
    doomed, later = list(range(8)), list(range(8, 16))
    frozen = False

    def pull(exporter: PeerProcess, engine_id: str, tid: str, remote: list[int], local: list[int]):
        exporter.call("export", slot="src", transfer_id=tid, block_ids=remote, block_hashes=None)
        fetcher.start_fetch(tid, PeerRef(engine_id, "addr"), remote, local)

    try:
        fetcher.register_kv_caches(dest)
        pull(old, "old", "warm-up", [40], [later[0]])
        fetcher.wait("warm-up", timeout_s=TIMEOUT_S + 10)
        old.call("export", slot="src", transfer_id="doomed", block_ids=doomed, block_hashes=None)
        old.process.send_signal(signal.SIGSTOP)
        frozen = True
        fetcher.start_fetch("doomed", PeerRef("old", "addr"), doomed, doomed)
        address["addr"] = known["new"]  # handshaking there forgets "old"
        pull(new, "new", "takeover", [41], [later[1]])
        fetcher.wait("takeover", timeout_s=TIMEOUT_S + 10)
        assert settles_failed(fetcher, "doomed", 1.0), "not failed with its peer dropped"
        assert fetcher.num_late_reads_running >= 1 and fetcher.num_late_fetches == 1
        assert not released(fetcher, "doomed", 0.5), "released while the READ runs"
        old.process.send_signal(signal.SIGCONT)
        frozen = False
        assert released(fetcher, "doomed", 10.0), "not released after the resume"
        reused = reuse(dest, doomed)

        if frozen:
            old.process.send_signal(signal.SIGCONT)
            frozen = False
        time.sleep(0.5)  # the old exporter answers the doomed READ
        for i, local in enumerate(later[2:]):
            pull(new, "new", f"after-{i}", [50 + i], [local])  # progress every lane
            fetcher.wait(f"after-{i}", timeout_s=TIMEOUT_S + 10)
        time.sleep(0.2)

        assert [block_digest(dest, b) for b in doomed] == reused
        assert fetcher.num_active_fetches == 0
        assert fetcher.num_late_reads_running == 0
    finally:
        if frozen:
            old.process.send_signal(signal.SIGCONT)
        fetcher.close()
        old.close()
        new.close()


@pytest.mark.timeout(60)
def test_a_timed_out_shared_storage_pull_does_not_read_files_written_later(tmp_path):
    """The exporter writes the block files only after the fetch gave up waiting for them:
    the fetcher reads nothing more (its reads are synchronous, in the fetch's own I/O
    threads, and end before the fetch settles)."""
    config = KVTransferConfig(
        connector="shared_storage", shared_dir=str(tmp_path), timeout_s=TIMEOUT_S
    )
    source = [torch.randn(BLOCK_SHAPE).to(torch.bfloat16) for _ in range(3)]
    dest = zero_caches()
    hashes = [bytes.fromhex(h) for h in random_hashes(8, SMALL_LAYOUT["block_size"],
                                                      random.Random("late"))]  # fmt: skip
    exporter = create_connector(config, "exporter")
    fetcher = create_connector(config, "fetcher")
    try:
        exporter.register_kv_caches(source)
        fetcher.register_kv_caches(dest)
        local = list(range(8))
        fetcher.start_fetch("late", PeerRef("exporter", ""), list(range(8)), local, hashes)
        with pytest.raises(KVTransferError):
            fetcher.wait("late", timeout_s=TIMEOUT_S + 10)
        reused = reuse(dest, local)
        exporter.export_blocks("late", list(range(8)), hashes)
        deadline = time.monotonic() + 10
        while "late" not in exporter.poll_finished_exports():
            assert time.monotonic() < deadline, "the exporter never wrote its files"
            time.sleep(0.01)
        time.sleep(0.2)
        assert [block_digest(dest, b) for b in local] == reused
    finally:
        fetcher.close()
        exporter.close()
