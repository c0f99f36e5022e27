"""Wire pieces of the NCCL connector: control messages, the handshake section, and the
process group that one (exporter, fetcher) pair shares.

Control messages are msgspec-tagged structs over ZMQ (exporter ROUTER, fetcher DEALER):

    fetcher                                   exporter
    Connect(pair_id, engine_id, layout,  -->  check the proof, then the layout; start
            proof)                              the pair's sender
                                         <--  Accepted(pair_id) | Rejected(pair_id, why)
    both open a 2-rank process group on the exporter's TCPStore, under prefix pair_id
    FetchRequest(pair_id, transfer_id,   -->  check the export holds those blocks
                 block_ids, layers_per_group, seq)
                                         <--  Accepted(transfer_id) | Rejected(...)
    <== one send/recv per layer group, tags tag(seq, group) ==
    Done(transfer_id) | Abort(transfer_id) -> the export is finished

The process group is a dedicated ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object over a
``PrefixStore``: it never touches torch.distributed's global default group.

``proof`` is HMAC-SHA256 of ``pair_id`` under the exporter's ``pair_key``, a random secret
that travels only in its handshake section (``NcclPayload``), which peers get from the
worker's gRPC ``GetTransferMetadata``: where ``PDSERVE_INTERNAL_TOKEN`` guards that call,
a caller without the token can open no pair (256 junk Connects had filled every pair slot
and turned real decode workers away) and learns nothing (a refusal named the layout).
The TCPStore's port takes no token (torch's own); a pair's keys there are under its
random ``pair_id``, which crosses the control socket only.

A message is bounded before its proof is checked (a security audit, 2026-12-02): its
ids are at most ``MAX_ID_CHARS`` (a peer's 15 MiB ``pair_id`` came back in each
``Rejected``, 586 MiB held for 40 of them), and its frame at most
``control_message_limit(num_blocks)`` bytes, what the longest ``FetchRequest`` this
exporter can take needs (frames of 16 MiB of block ids took 0.25 s each to decode, and
a 15 s flood held a worker's CPU for minutes).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import time
from typing import Annotated

import msgspec
import torch
import torch.distributed as dist

from engine.parallel.group import process_group
from kv_transfer.errors import TransferTimeoutError
from kv_transfer.layout import KVLayout


class NcclPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The NCCL section of the handshake envelope."""

    host: str
    control_port: int
    store_port: int
    backend: str  # "gloo" (CPU caches) or "nccl" (CUDA caches)
    pair_key: bytes = b""  # what a Connect proves it knows (module docstring)


MAX_ID_CHARS = 256  # pair, transfer and engine ids: a prefix and a uuid's hex
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]


def control_message_limit(num_blocks: int) -> int:
    """The largest control frame an exporter of ``num_blocks`` blocks takes: a
    ``FetchRequest`` naming each block once (at most 5 bytes an id in msgpack), and room
    for the rest (a ``Connect``'s layout, the ids)."""
    return (64 << 10) + 5 * num_blocks


class Connect(msgspec.Struct, frozen=True, tag=True):
    pair_id: Id
    engine_id: Id
    layout: KVLayout
    proof: bytes = b""  # connect_proof(pair_key, pair_id)


def connect_proof(pair_key: bytes, pair_id: str) -> bytes:
    return hmac.new(pair_key, pair_id.encode(), hashlib.sha256).digest()


class FetchRequest(msgspec.Struct, frozen=True, tag=True):
    pair_id: Id
    transfer_id: Id
    block_ids: list[int]
    layers_per_group: int
    seq: int  # per pair, so that tags of consecutive transfers never collide


class Done(msgspec.Struct, frozen=True, tag=True):
    transfer_id: Id


class Abort(msgspec.Struct, frozen=True, tag=True):
    transfer_id: Id


class Accepted(msgspec.Struct, frozen=True, tag=True):
    request_id: Id  # pair id or transfer id


class Rejected(msgspec.Struct, frozen=True, tag=True):
    request_id: Id
    reason: str
    layout_mismatch: bool = False
    unknown_pair: bool = False  # the exporter dropped the pair (idle, failed): reconnect


ToExporter = Connect | FetchRequest | Done | Abort
ToFetcher = Accepted | Rejected

_TO_EXPORTER = msgspec.msgpack.Decoder(ToExporter)
_TO_FETCHER = msgspec.msgpack.Decoder(ToFetcher)


def encode(message: ToExporter | ToFetcher) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_to_exporter(data: bytes) -> ToExporter:
    return _TO_EXPORTER.decode(data)


def decode_to_fetcher(data: bytes) -> ToFetcher:
    return _TO_FETCHER.decode(data)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_pair_group(
    store: dist.Store, pair_id: str, rank: int, backend: str, host: str, timeout_s: float
) -> dist.ProcessGroup:
    """The 2-rank group of one pair (rank 0 exports, rank 1 fetches). Blocks until both
    ranks have joined or ``timeout_s`` passes. Gloo binds its sockets to ``host``."""
    prefixed = dist.PrefixStore(f"kv_transfer/{pair_id}/", store)
    return process_group(prefixed, rank, 2, backend, host, timeout_s)


def tag(seq: int, group: int, num_groups: int) -> int:
    """A tag unique per (transfer, group) within a pair, kept below 2**31."""
    return (seq * num_groups + group) % (1 << 31)


def wait_work(work: dist.Work, deadline: float, device: torch.device) -> None:
    """Wait for a send/recv until the monotonic ``deadline``; raise on timeout or error."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferTimeoutError("transfer deadline passed")
    if device.type == "cuda":
        # NCCL's wait() only orders streams; poll for CPU-side completion instead.
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise TransferTimeoutError("NCCL transfer still running at the deadline")
            time.sleep(50e-6)
        work.wait()
        torch.cuda.current_stream(device).synchronize()
        return
    try:
        work.wait(datetime.timedelta(seconds=remaining))
    except RuntimeError as exc:
        if "Timed out" in str(exc) and time.monotonic() >= deadline - 1e-3:
            raise TransferTimeoutError(f"transfer still running at the deadline: {exc}") from exc
        raise


def abort_group(group: dist.ProcessGroup | None) -> None:
    """Abort a pair's group after a failure, so that no pending op touches its buffers."""
    if group is None:
        return
    with contextlib.suppress(Exception):  # best effort: the group is being discarded
        group.abort()
