"""What rank 0 and its shard processes say to each other (msgpack via msgspec, never pickle).

Rank 0 sends each shard one ordered stream of commands; a shard answers on one stream back.
Order is the contract: a shard applies commands in the order rank 0 issued them, so a
block copy or a transfer ordered before a step happens before that step on every rank.

    rank 0                                shard r
    ------                                -------
    spawn ─────────────────────────────►  Hello            (imports done, joins the group)
                                          Loaded(max_num_blocks)
    Allocate(num_blocks) ──────────────►  KV cache, CUDA graphs (collectives: all ranks)
                                          Started(extension payload)
    Step                                  (no answer: its answer is the collectives)
    MtpPass                               the MTP layer's passes after a step (drafts)
    PlaceExperts                          a new expert placement (collectives: all ranks)
    OpenHostCache / SaveBlocks / LoadBlocks   the CPU tier's copies of this rank's blocks
    AddLora ─► LoraAdded / DropLora
    Probe ─► ProbeReply                   what a shard holds, for leak checks
    extension commands  ──────────────►   extension replies, whenever they come
    Shutdown ──────────────────────────►  exits
                                          Failed(reason): the shard is going down

A worker's KV connector rides on the same streams as an *extension*
(``shard_main.ShardExtension``): its message types join these unions.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class Hello(msgspec.Struct, tag="hello", frozen=True):
    rank: int


class Loaded(msgspec.Struct, tag="loaded", frozen=True):
    rank: int
    max_num_blocks: int  # what this rank's memory holds


class Allocate(msgspec.Struct, tag="allocate", frozen=True):
    num_blocks: int  # the smallest any rank can hold: block ids name the same slot on all


class Started(msgspec.Struct, tag="started", frozen=True):
    rank: int
    extension: bytes = b""  # what the extension tells rank 0 (a connector's metadata)


class Failed(msgspec.Struct, tag="failed", frozen=True):
    rank: int
    reason: str


class Step(msgspec.Struct, tag="step", frozen=True):
    """One forward pass: ``model_shard.HostBatch``'s lists, the rows of each adapter, and
    the rows of each logits pass after it (every rank computes its slice of the
    vocabulary's logits; rank 0 gathers them)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: bytes  # HostBatch.block_table's int32 values, row-major
    block_table_width: int
    lora_rows: list[tuple[int, list[int]]]  # (adapter id from AddLora, rows)
    logit_rows: list[list[int]]  # per logits pass, in order
    # Rows whose embeddings are a vision-language model's image rows: rank 0 encodes the
    # images and broadcasts the rows' embeddings to the group (``ModelShard.forward``).
    image_rows: list[int] = []
    # ``HostBatch.key_ends`` (images that attend both ways); empty: causal.
    key_ends: list[int] = []
    # ``HostBatch.rope_positions`` and ``mrope_positions`` (M-RoPE); empty: none.
    rope_positions: list[int] = []
    mrope_positions: list[list[int]] = []
    # A hybrid model's ``HostBatch.state_slots`` and ``fresh_slots`` (rank 0 assigns the
    # slots; every rank holds its heads' states in the same slot).
    state_slots: list[int] = []
    fresh_slots: list[int] = []
    # ``HostBatch.state_restores`` and ``state_snapshots``: [slot, *block ids] each.
    state_restores: list[list[int]] = []
    state_snapshots: list[list[int]] = []
    # ``HostBatch.state_accepts`` ([source, dest] slots) and ``state_drafts`` ([sequence
    # index, *slots]): a decode verifying drafts.
    state_accepts: list[list[int]] = []
    state_drafts: list[list[int]] = []


class MtpPass(msgspec.Struct, tag="mtp_pass", frozen=True):
    """One pass of the MTP layer after a step (``engine/mtp_drafts.py``): a batch as in
    ``Step``, the rows of the states it reads (the last ``Step``'s before the final norm
    when ``from_target``, else the last pass's logits rows), and the rows that get logits
    (every rank computes its vocabulary slice; rank 0 gathers them)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: bytes
    block_table_width: int
    hidden_rows: list[int]
    from_target: bool
    logit_rows: list[int]


class PlaceExperts(msgspec.Struct, tag="place_experts", frozen=True):
    """Run these expert placements, one per expert-parallel layer
    (``ModelShard.place_experts``: every rank exchanges experts at once)."""

    placements: list[list[int]]


class OpenHostCache(msgspec.Struct, tag="open_host_cache", frozen=True):
    """Make this many CPU tier slots (``engine.cpu_tier``); the tier's copies follow."""

    num_slots: int


class SaveBlocks(msgspec.Struct, tag="save", frozen=True):
    """Copy KV blocks into CPU tier slots (``engine.cpu_tier``)."""

    block_ids: list[int]
    slots: list[int]


class LoadBlocks(msgspec.Struct, tag="load", frozen=True):
    slots: list[int]
    block_ids: list[int]


class AddLora(msgspec.Struct, tag="add_lora", frozen=True):
    adapter_id: int
    name: str
    path: str


class LoraAdded(msgspec.Struct, tag="lora_added", frozen=True):
    rank: int
    adapter_id: int
    fingerprint: str = ""  # of the files the shard read
    error: str = ""  # set: the shard could not read them (and holds nothing)


class DropLora(msgspec.Struct, tag="drop_lora", frozen=True):
    adapter_id: int


class Probe(msgspec.Struct, tag="probe", frozen=True):
    """Ask what a shard holds (leak checks)."""


class ProbeReply(msgspec.Struct, tag="probe_reply", frozen=True):
    rank: int
    num_adapters: int
    num_host_slots: int


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


TO_SHARD = (Allocate, Step, MtpPass, PlaceExperts, OpenHostCache, SaveBlocks, LoadBlocks,
            AddLora, DropLora, Probe, Shutdown)  # fmt: skip
FROM_SHARD = (Hello, Loaded, Started, Failed, LoraAdded, ProbeReply)


def decoder_of(types: tuple[type, ...]) -> msgspec.msgpack.Decoder:
    """A decoder of any of ``types`` (tagged structs), and nothing else."""
    union: Any = Union[types]  # noqa: UP007 (a runtime tuple of types)
    return msgspec.msgpack.Decoder(union)
