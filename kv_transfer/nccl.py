"""NCCL connector: torch.distributed point-to-point per (exporter, fetcher) pair.

NCCL moves CUDA caches, gloo moves CPU caches; both through a dedicated 2-rank process
group per pair that rendezvouses on the exporter's TCPStore (bound to ``config.host``),
never through the global default group. The fetcher tells the exporter what to send with
a small msgspec message over ZMQ (see ``nccl_protocol.py``); the exporter packs the blocks
of a layer group into one contiguous buffer, so a transfer is one send/recv per layer
group, not one per block. Exporter half: ``nccl_export.py``; fetcher half:
``nccl_fetch.py``. NCCL itself cannot pair two ranks on one GPU, so on a single-GPU host
only gloo (CPU caches) can be exercised.
"""

from __future__ import annotations

import os
import threading
import time

import msgspec
import zmq

from common.hosts import host_port, url_host
from common.tcp_store import bound_tcp_store
from common.zmq_tcp import tcp_socket
from kv_transfer.base import KVConnector
from kv_transfer.config import ConnectorName, KVTransferConfig
from kv_transfer.handshake import MetadataFetcher, fetch_peer_metadata
from kv_transfer.layout import KVCaches
from kv_transfer.nccl_export import ExportServer, ExportSettings
from kv_transfer.nccl_fetch import FetchSettings, PeerFetcher
from kv_transfer.nccl_protocol import NcclPayload, backend_for, control_message_limit
from kv_transfer.records import ExportRecord, FetchRecord


class NcclConnector(KVConnector):
    name = ConnectorName.NCCL

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        fetch_peer_metadata: MetadataFetcher | None = None,
    ) -> None:
        super().__init__(config, engine_id, fetch_peer_metadata)
        self._context = zmq.Context()
        self._fetchers: dict[str, PeerFetcher] = {}
        self._lock = threading.Lock()  # guards _fetchers against close()
        self._server: ExportServer | None = None

    def _on_register(self, kv: KVCaches) -> None:
        config = self.config
        self._backend = backend_for(kv.device)
        # (TCPStore alone would listen on every interface: ``common/tcp_store.py``.)
        self._store = bound_tcp_store(config.host, config.store_port, None, config.timeout_s)
        self._store_port = self._store.port
        router = tcp_socket(self._context, zmq.ROUTER, config.host)
        router.setsockopt(zmq.MAXMSGSIZE, control_message_limit(kv.num_blocks))
        try:
            if config.port:
                router.bind(f"tcp://{host_port(config.host, config.port)}")
                self._control_port = config.port
            else:
                self._control_port = router.bind_to_random_port(f"tcp://{url_host(config.host)}")
        except zmq.ZMQError:
            router.close(0)  # else close()'s context.term() waits for it for ever
            raise
        self._pair_key = os.urandom(32)  # (``nccl_protocol.py``: who may open a pair)
        settings = ExportSettings(
            config.host,
            self._store_port,
            self._backend,
            config.timeout_s,
            config.peer_idle_s,
            self._pair_key,
        )
        self._server = ExportServer(router, kv, self._exports, settings)
        self._server.start()

    def _transport_metadata(self) -> bytes:
        return msgspec.msgpack.encode(
            NcclPayload(
                host=self.config.host,
                control_port=self._control_port,
                store_port=self._store_port,
                backend=self._backend,
                pair_key=self._pair_key,
            )
        )

    def _on_export(self, record: ExportRecord) -> None:
        pass  # the fetcher asks for it over the control socket

    def _on_fetch(self, record: FetchRecord) -> None:
        peer_id = record.peer.engine_id
        with self._lock:
            self._stop_idle_fetchers()
            fetcher = self._fetchers.get(peer_id)
            if fetcher is None:
                config = self.config
                settings = FetchSettings(
                    self.engine_id, config.host, config.staging_bytes, config.timeout_s
                )
                fetcher = PeerFetcher(
                    peer_id, self.kv, self._fetches, self._lookup, self._context, settings
                )
                self._fetchers[peer_id] = fetcher
                fetcher.start()
            fetcher.last_used = time.monotonic()
            fetcher.submit(record)

    def _stop_idle_fetchers(self) -> None:
        """Under ``_lock``: stop fetchers whose peer has had no fetch for ``peer_idle_s``
        (a restarted prefill worker comes back under a new engine id; the old fetcher's
        thread, connection and staging would stay for good). Their last fetch is long
        settled: it had ``timeout_s`` < ``peer_idle_s``."""
        cutoff = time.monotonic() - self.config.peer_idle_s
        for peer_id, fetcher in list(self._fetchers.items()):
            if fetcher.last_used < cutoff:
                del self._fetchers[peer_id]
                fetcher.stop()

    def _lookup(self, record: FetchRecord) -> tuple[int, bytes]:
        """Handshake, on the peer's fetcher thread."""
        metadata = fetch_peer_metadata(
            self._fetch_peer_metadata, record.peer, connector=self.name, local_layout=self.layout
        )
        return metadata.num_blocks, metadata.transport

    def _close(self) -> None:
        with self._lock:
            fetchers = list(self._fetchers.values())
            self._fetchers.clear()
        for fetcher in fetchers:
            fetcher.stop()
        if self._server is not None:
            self._server.stop()
            self._server.join()
            # The TCPStore server keeps listening (on the configured host) until the
            # connector is collected: dropping it here, while a pair's process group may
            # still hold it, aborted the process at exit (std::terminate) in CI.
        for fetcher in fetchers:
            fetcher.join(timeout=self.config.timeout_s)
        if all(not fetcher.is_alive() for fetcher in fetchers):
            self._context.term()  # every socket is closed; term() would block otherwise
