"""Two connectors in this process, an exporter and a fetcher, wired to each other: for tests
that reach into one side (its lanes, its sockets) while a real fetch runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer import KVConnector, KVTransferConfig, PeerRef, create_connector


def wired_pair(
    config: KVTransferConfig,
    name: str,
    source: Sequence[torch.Tensor],
    dest: Sequence[torch.Tensor],
) -> tuple[KVConnector, KVConnector, PeerRef]:
    """``{name}-exporter`` over ``source`` and ``{name}-fetcher`` over ``dest``, and the
    fetcher's reference to the exporter. The caller closes both."""
    known: dict[str, bytes] = {}
    exporter = create_connector(config, f"{name}-exporter", known.__getitem__)
    fetcher = create_connector(config, f"{name}-fetcher", known.__getitem__)
    try:
        exporter.register_kv_caches(source)
        fetcher.register_kv_caches(dest)
        known["exporter"] = exporter.metadata()
    except BaseException:
        fetcher.close()
        exporter.close()
        raise
    return exporter, fetcher, PeerRef(f"{name}-exporter", "exporter")
