"""Peers that went away are forgotten: restarted workers come back under new engine ids,
so without this every restart left a thread, a connection and staging buffers (NCCL) or a
remote agent in every lane (NIXL) behind for good, and NCCL exporters ran into MAX_PAIRS.
NIXL keeps live peers, however idle (forgetting them leaked connections)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from kv_transfer import KVTransferConfig, PeerRef, create_connector
from tests.support.polling import eventually

SHAPE = (16, 2, 4, 2, 8)  # 16 blocks
TIMEOUT_S, IDLE_S = 2.0, 3.0


def _config(connector: str) -> KVTransferConfig:
    return KVTransferConfig(connector=connector, timeout_s=TIMEOUT_S, peer_idle_s=IDLE_S)


def _exporter(connector: str, engine_id: str, known: dict):
    source = [torch.randn(SHAPE) for _ in range(2)]
    exporter = create_connector(_config(connector), engine_id, known.__getitem__)
    exporter.register_kv_caches(source)
    known[engine_id] = exporter.metadata()
    return exporter, source


def _fetcher(connector: str, engine_id: str, known: dict):
    dest = [torch.zeros(SHAPE) for _ in range(2)]
    fetcher = create_connector(_config(connector), engine_id, known.__getitem__)
    fetcher.register_kv_caches(dest)
    return fetcher, dest


def _transfer(exporter, exporter_id, source, fetcher, dest, transfer_id: str) -> None:
    exporter.export_blocks(transfer_id, [3, 7])
    fetcher.start_fetch(transfer_id, PeerRef(exporter_id, exporter_id), [3, 7], [1, 2])
    fetcher.wait(transfer_id, timeout_s=30)
    assert all(torch.equal(d[[1, 2]], s[[3, 7]]) for d, s in zip(dest, source, strict=True))


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


@pytest.mark.timeout(90)
def test_nccl_exporter_drops_replaced_and_idle_pairs_and_fetchers_reconnect():
    known: dict = {}
    exporter, source = _exporter("nccl", "prefill", known)
    pairs = exporter._server._pairs
    with exporter:
        for i in range(3):  # the same decode worker reconnecting, e.g. after an error
            fetcher, dest = _fetcher("nccl", "decode", known)
            with fetcher:
                _transfer(exporter, "prefill", source, fetcher, dest, f"again-{i}")
                assert eventually(lambda: len(pairs) == 1)
        live, dest = _fetcher("nccl", "decode-2", known)  # a restarted one: a new engine id
        with live:
            _transfer(exporter, "prefill", source, live, dest, "live-1")
            # Neither fetcher fetches now: both pairs (the closed one's, the live one's) go.
            assert eventually(lambda: not pairs, IDLE_S + 10)
            assert eventually(lambda: _threads("nccl-send-") == 0)
            # The live fetcher still has its connection; the exporter says it dropped the
            # pair, and the fetch connects again within its deadline.
            _transfer(exporter, "prefill", source, live, dest, "live-2")
            assert len(pairs) == 1


@pytest.mark.timeout(90)
def test_nccl_fetcher_stops_its_thread_for_a_peer_gone_idle():
    known: dict = {}
    fetcher, dest = _fetcher("nccl", "decode", known)
    with fetcher:
        old, source = _exporter("nccl", "prefill-old", known)
        with old:
            _transfer(old, "prefill-old", source, fetcher, dest, "t1")
        time.sleep(IDLE_S + 0.5)  # the old prefill worker is gone; a new one comes
        new, source = _exporter("nccl", "prefill-new", known)
        with new:
            _transfer(new, "prefill-new", source, fetcher, dest, "t2")
            assert list(fetcher._fetchers) == ["prefill-new"]
            assert eventually(lambda: _threads("nccl-fetch-prefill-old") == 0)


def _sockets() -> set[str]:
    """The sockets this process holds open ("socket:[inode]"; UCX's TCP connections among
    them)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith("socket:"):
                found.add(target)
    return found


def _tcp_endpoints() -> dict[str, tuple[str, str]]:
    """Every TCP socket on this host: "socket:[inode]" -> (local, remote) address."""
    endpoints = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                endpoints[f"socket:[{fields[9]}]"] = (fields[1], fields[2])
    return endpoints


def _new_lasting_sockets(before: set[str]) -> set[str]:
    """TCP connections opened since ``before``, still open 0.5 s later, whose peer is in
    this process. Both NIXL agents live in this process, so a leaked UCX connection shows
    as such sockets, and lasts. What an object an earlier test in this xdist process left
    behind may open meanwhile is not that: a connect attempt comes and goes (it once failed
    this check when it counted every socket), a client's connection to another process (a
    redis pool, a channel to a server) has its peer there (one once failed it when it
    counted lasting sockets), and a Unix or netlink socket is no UCX lane (one failed it
    when it counted sockets that are not TCP)."""
    new = _sockets() - before
    time.sleep(0.5)
    lasting, everything = new & _sockets(), _sockets()
    endpoints = _tcp_endpoints()
    here = {endpoints[socket][0] for socket in everything if socket in endpoints}
    return {s for s in lasting if s in endpoints and endpoints[s][1] in here}


@pytest.mark.timeout(90)
def test_nixl_fetcher_keeps_a_live_idle_peer_and_forgets_a_gone_one():
    """An idle peer is asked whether it is still there. Alive, it is kept: forgetting it
    and handshaking again on the next fetch leaked lanes + 1 TCP connections in both
    processes each time (NIXL's remove_remote_agent leaves them open). Gone (its endpoint
    no longer answers as itself), it is forgotten in every lane."""
    known: dict = {}
    fetcher, dest = _fetcher("nixl", "decode", known)
    with fetcher:
        exporter, source = _exporter("nixl", "prefill", known)
        with exporter:
            # Fetches go to the lanes in turn, and a lane's UCX endpoint connects on its
            # first READ: one fetch per lane first, so that the fetches after the idle
            # wait connect nothing new unless the peer was loaded again (a fetch before
            # it on one lane only let the second lane's first connection fail the check).
            num_lanes = len(fetcher._lanes)
            for i in range(num_lanes):
                _transfer(exporter, "prefill", source, fetcher, dest, f"before-{i}")
            peer, sockets = fetcher._peers["prefill"], _sockets()
            loaded = [lane._peers["prefill"] for lane in fetcher._lanes]
            time.sleep(IDLE_S + 1.5)  # idle long enough to be probed, and kept
            assert fetcher._peers.get("prefill") is peer
            for i in range(num_lanes):
                _transfer(exporter, "prefill", source, fetcher, dest, f"after-{i}")
            assert fetcher._peers.get("prefill") is peer  # no second handshake
            # ... and no lane loaded the peer's agent again
            lanes = zip(fetcher._lanes, loaded, strict=True)
            assert all(lane._peers["prefill"] is was for lane, was in lanes)
            assert not _new_lasting_sockets(sockets)  # no new connections (the leak)
            del known["prefill"]  # the worker is gone: its address answers no more
            assert eventually(lambda: not fetcher._peers, IDLE_S + 10)
            assert eventually(lambda: all(not lane._peers for lane in fetcher._lanes))


@pytest.mark.timeout(90)
def test_nixl_fetcher_keeps_a_live_peer_whose_probe_failed_once():
    """One failed metadata call (a deadline under load) dropped a live idle peer, and
    dropping a live one leaks its connections: a peer is dropped when another engine
    answers, or after three silent probes in a row."""
    known: dict = {}
    calls = []

    def flaky(endpoint: str) -> bytes:
        calls.append(endpoint)
        if len(calls) == 2:  # the first probe (the first call was the handshake)
            raise TimeoutError("deadline exceeded")
        return known[endpoint]

    dest = [torch.zeros(SHAPE) for _ in range(2)]
    fetcher = create_connector(_config("nixl"), "decode", flaky)
    fetcher.register_kv_caches(dest)
    with fetcher:
        exporter, source = _exporter("nixl", "prefill", known)
        with exporter:
            _transfer(exporter, "prefill", source, fetcher, dest, "first")
            peer = fetcher._peers["prefill"]
            assert eventually(lambda: len(calls) >= 3, IDLE_S + 10)  # failed, asked again
            assert fetcher._peers.get("prefill") is peer
            _transfer(exporter, "prefill", source, fetcher, dest, "after")
            assert fetcher._peers.get("prefill") is peer and peer.silent_probes == 0


@pytest.mark.timeout(90)
def test_nixl_fetcher_drops_a_peer_whose_address_answers_as_a_new_engine():
    """A prefill worker restarted behind the same address (a new engine id): the old
    peer goes at the new one's handshake, without waiting to be idle."""
    known: dict = {}
    fetcher, dest = _fetcher("nixl", "decode", known)
    with fetcher:
        for engine_id in ("prefill-old", "prefill-new"):
            exporter, source = _exporter("nixl", engine_id, known)
            known["prefill@host:18100"] = known[engine_id]
            with exporter:
                exporter.export_blocks(engine_id, [3, 7])
                peer = PeerRef(engine_id, "prefill@host:18100")
                fetcher.start_fetch(engine_id, peer, [3, 7], [1, 2])
                fetcher.wait(engine_id, timeout_s=30)
                pairs = zip(dest, source, strict=True)
                assert all(torch.equal(d[[1, 2]], s[[3, 7]]) for d, s in pairs)
                assert list(fetcher._peers) == [engine_id]
                # A lane applies its commands on its own thread, in order: one that read
                # no part of this fetch may not have applied the drop and the add yet.
                assert eventually(
                    lambda id=engine_id: all(list(lane._peers) == [id] for lane in fetcher._lanes)
                )


def test_the_idle_time_follows_a_long_pull_timeout():
    """A deployment's pull timeout may be long; the idle time (not a deployment key)
    must never refuse it."""
    assert KVTransferConfig(timeout_s=400.0).peer_idle_s == 1200.0
    assert KVTransferConfig().peer_idle_s == 300.0
    with pytest.raises(ValueError, match="peer_idle_s"):
        KVTransferConfig(timeout_s=10.0, peer_idle_s=5.0)
