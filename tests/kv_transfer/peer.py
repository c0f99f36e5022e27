"""A separate process hosting connectors, driven by the test over stdin/stdout.

One JSON object per line each way (msgspec.json; bytes as hex strings): the test sends
``{"op": ..., ...}`` and gets ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``. The
process can host several connectors ("slots"), each with its own random KV cache, so a
pair of processes serves a whole test module. fd 1 is redirected to stderr at start so
that library logging can never corrupt the protocol stream.

    python -m tests.kv_transfer.peer
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kv_transfer import KVConnector, KVTransferConfig, PeerRef, create_connector


@dataclass
class Slot:
    connector: KVConnector
    kv_caches: list[torch.Tensor]
    fetch_started: dict[str, float] = field(default_factory=dict)
    finished_exports: set[str] = field(default_factory=set)


def random_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_shape: list[int],
    dtype: str,
    seed: int,
    block_major: bool = False,
) -> list[torch.Tensor]:
    """Caches of random *bit patterns* (NaNs and infinities included), so that any copy
    through float arithmetic instead of raw bytes would show. ``block_major``: the layers
    are views of one [num_blocks, num_layers, ...] buffer, as the engine allocates them;
    else each layer is its own tensor."""
    torch_dtype = getattr(torch, dtype)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch_dtype.itemsize]
    generator = torch.Generator().manual_seed(seed)
    low, high = -(2 ** (8 * torch_dtype.itemsize - 1)), 2 ** (8 * torch_dtype.itemsize - 1)
    if block_major:
        shape = (num_blocks, num_layers, *block_shape)
        buffer = torch.randint(low, high, shape, dtype=bits, generator=generator)
        return [buffer[:, layer].view(torch_dtype) for layer in range(num_layers)]
    shape = (num_blocks, *block_shape)
    return [
        torch.randint(low, high, shape, dtype=bits, generator=generator).view(torch_dtype)
        for _ in range(num_layers)
    ]


def block_digest(kv_caches: list[torch.Tensor], block_id: int) -> str:
    h = hashlib.sha256()
    for layer in kv_caches:
        h.update(layer[block_id].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Peer:
    def __init__(self) -> None:
        self.slots: dict[str, Slot] = {}
        self.known_metadata: dict[str, bytes] = {}  # endpoint -> metadata

    def fetch_peer_metadata(self, endpoint: str) -> bytes:
        return self.known_metadata[endpoint]

    def op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def op_create(
        self, slot: str, engine_id: str, config: dict, layout: dict, seed: int
    ) -> dict[str, Any]:
        kv_caches = random_kv_caches(
            layout["num_layers"],
            layout["num_blocks"],
            [2, layout["block_size"], layout["num_kv_heads"], layout["head_dim"]],
            layout["dtype"],
            seed,
            layout.get("block_major", False),
        )
        connector = create_connector(
            KVTransferConfig(**config), engine_id, self.fetch_peer_metadata
        )
        connector.register_kv_caches(kv_caches)
        self.slots[slot] = Slot(connector, kv_caches)
        return {"metadata": connector.metadata().hex()}

    def op_metadata(self, slot: str) -> dict[str, Any]:
        return {"metadata": self.slots[slot].connector.metadata().hex()}

    def op_add_peer(self, endpoint: str, metadata: str) -> dict[str, Any]:
        self.known_metadata[endpoint] = bytes.fromhex(metadata)
        return {}

    def op_digests(self, slot: str, block_ids: list[int]) -> dict[str, Any]:
        kv_caches = self.slots[slot].kv_caches
        return {"digests": [block_digest(kv_caches, b) for b in block_ids]}

    def op_export(
        self, slot: str, transfer_id: str, block_ids: list[int], block_hashes: list[str] | None
    ) -> dict[str, Any]:
        hashes = None if block_hashes is None else [bytes.fromhex(h) for h in block_hashes]
        self.slots[slot].connector.export_blocks(transfer_id, block_ids, hashes)
        return {}

    def op_fetch(
        self,
        slot: str,
        transfer_id: str,
        engine_id: str,
        endpoint: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        block_hashes: list[str] | None,
    ) -> dict[str, Any]:
        s = self.slots[slot]
        hashes = None if block_hashes is None else [bytes.fromhex(h) for h in block_hashes]
        s.fetch_started[transfer_id] = time.monotonic()
        peer = PeerRef(engine_id, endpoint)
        s.connector.start_fetch(transfer_id, peer, remote_block_ids, local_block_ids, hashes)
        return {}

    def op_wait(self, slot: str, transfer_ids: list[str], wait_s: float) -> dict[str, Any]:
        """Settle each fetch; report ok/error type and seconds since its start_fetch."""
        s = self.slots[slot]
        deadline = time.monotonic() + wait_s
        results = {}
        for tid in transfer_ids:
            try:
                s.connector.wait(tid, max(0.0, deadline - time.monotonic()))
                outcome: dict[str, Any] = {"ok": True}
            except TimeoutError:
                outcome = {"ok": False, "error_type": "StillRunning", "error": ""}
            except Exception as exc:
                outcome = {"ok": False, "error_type": type(exc).__name__, "error": str(exc)}
            outcome["elapsed_s"] = time.monotonic() - s.fetch_started[tid]
            results[tid] = outcome
        return {"results": results}

    def op_finished_exports(self, slot: str, expect: list[str], wait_s: float) -> dict[str, Any]:
        """Poll until every id in ``expect`` has been reported finished (or time out)."""
        s = self.slots[slot]
        deadline = time.monotonic() + wait_s
        while True:
            s.finished_exports.update(s.connector.poll_finished_exports())
            if set(expect) <= s.finished_exports or time.monotonic() > deadline:
                return {"finished": sorted(s.finished_exports)}
            time.sleep(0.005)

    def op_release_export(self, slot: str, transfer_id: str) -> dict[str, Any]:
        self.slots[slot].connector.release_export(transfer_id)
        return {}

    def op_counts(self, slot: str) -> dict[str, Any]:
        connector = self.slots[slot].connector
        return {"exports": connector.num_active_exports, "fetches": connector.num_active_fetches}

    def op_close(self, slot: str) -> dict[str, Any]:
        self.slots.pop(slot).connector.close()
        return {}


def main() -> None:
    protocol_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints and library logs go to stderr
    sys.stdout = sys.stderr
    peer = Peer()
    for line in sys.stdin:
        request = msgspec.json.decode(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            reply = {"ok": True, **getattr(peer, f"op_{op}")(**request)}
        except Exception as exc:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        protocol_out.write(msgspec.json.encode(reply).decode() + "\n")
    for slot in list(peer.slots):
        peer.op_close(slot)


if __name__ == "__main__":
    main()
