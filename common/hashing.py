"""Chained prefix-block hashes, shared by the engine's prefix cache and the router's index.

A full block of ``block_size`` tokens is named by

    H(parent_hash || len(token_ids) || token_ids || extra)

where ``H`` is sha256, the parent hash of the first block is a seed derived from an optional
salt (the tenant's cache_salt and the LoRA adapter: ``prefix_salt``), token ids are
little-endian uint32 and ``extra`` is optional bytes: the images a block overlaps
(``common.multimodal.block_extra``), since their placeholder tokens are alike. The
encoding is canonical, so the same tokens give the same hash in every process, on every
machine, in every Python version. Python's ``hash()`` is
never used: it is salted per process and collides on purpose-built inputs.

Only full blocks are hashed; a trailing partial block has no hash and is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from common.multimodal import ImageSpan, block_extra

BlockHash = bytes
"""A 32-byte sha256 digest naming one full block and, through its parent, its whole prefix."""

_ROOT_DOMAIN = b"pdserve-block-hash-v1"


def root_hash(salt: str | bytes | None = None) -> BlockHash:
    """The parent hash of a sequence's first block. Different salts never share blocks."""
    if salt is None:
        salt_bytes = b""
    elif isinstance(salt, str):
        salt_bytes = salt.encode()
    else:
        salt_bytes = bytes(salt)
    return hashlib.sha256(_ROOT_DOMAIN + struct.pack("<I", len(salt_bytes)) + salt_bytes).digest()


_LORA_SALT_TAG = b"\xfflora"  # 0xff never occurs in UTF-8: no cache_salt string has this form


def lora_key(name: str, fingerprint: str) -> str:
    """What a LoRA adapter's KV is keyed by: its name and its weights' fingerprint
    (``engine.models.fingerprint.adapter_fingerprint``). An adapter unloaded and loaded
    again under its name with other weights must never read the old weights' KV, in any
    worker's prefix cache, CPU tier or shared store; with the same weights it may."""
    return f"{name}@{fingerprint}"


def prefix_salt(cache_salt: str | None, lora: str | None) -> str | bytes | None:
    """The salt of a request's block hashes, from its tenant salt and its LoRA adapter's
    ``lora_key`` (None: the base model).

    Without an adapter it is the cache_salt itself (base-model hashes are unchanged). With
    one, it is bytes that no cache_salt can equal, so no tenant salt reaches an adapter's
    blocks, and no adapter's blocks serve the base model or another adapter.
    """
    if lora is None:
        return cache_salt
    parts = [lora.encode(), (cache_salt or "").encode()]
    return _LORA_SALT_TAG + b"".join(struct.pack("<I", len(p)) + p for p in parts)


def hash_block(
    parent_hash: BlockHash, token_ids: Sequence[int], extra: bytes | None = None
) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    if extra:
        h.update(struct.pack("<I", len(extra)))
        h.update(extra)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | bytes | None = None,
    parent_hash: BlockHash | None = None,
    start_block: int = 0,
    images: Sequence[ImageSpan] = (),
    first_position: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from block index ``start_block`` on.

    ``parent_hash`` is the hash of block ``start_block - 1`` (or the salt's root when
    ``start_block`` is 0), which lets a caller extend a list incrementally as tokens arrive.
    ``images`` are the sequence's (placed by prompt position); ``token_ids[0]`` is at
    position ``first_position`` of it (a caller hashing only new blocks passes them alone).
    """
    assert block_size > 0
    parent = root_hash(salt) if parent_hash is None else parent_hash
    assert start_block == 0 or parent_hash is not None, "a non-zero start needs its parent"
    num_full_blocks = len(token_ids) // block_size
    hashes: list[BlockHash] = []
    for block_idx in range(start_block, num_full_blocks):
        start = block_idx * block_size
        end = start + block_size
        extra = None
        if images:
            extra = block_extra(images, first_position + start, first_position + end)
        parent = hash_block(parent, token_ids[start:end], extra)
        hashes.append(parent)
    return hashes


def transfer_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | bytes | None = None,
    images: Sequence[ImageSpan] = (),
) -> list[BlockHash]:
    """A name for every block of ``token_ids``, the trailing partial block included.

    Full blocks get their prefix-cache hash; a partial block is hashed over its own tokens
    (the encoding includes the length, so it never collides with a full block). Transfers
    keyed by content (the shared-storage connector) use these names on both sides.
    """
    hashes = hash_blocks(token_ids, block_size, salt, images=images)
    remainder = len(token_ids) % block_size
    if remainder:
        parent = hashes[-1] if hashes else root_hash(salt)
        start = len(token_ids) - remainder
        extra = block_extra(images, start, len(token_ids)) if images else None
        hashes.append(hash_block(parent, token_ids[start:], extra))
    return hashes


_STATE_DOMAIN = b"pdserve-linear-state"


def state_block_hashes(last_block_hash: BlockHash, num_blocks: int) -> list[BlockHash]:
    """Names of the blocks that carry a hybrid model's linear-attention states after a
    prompt whose last block (partial or full) is named ``last_block_hash``: the states
    follow from that prompt alone, as its KV does, so both sides of a transfer derive the
    same names (``engine/linear_state.py``)."""
    return [
        hashlib.sha256(_STATE_DOMAIN + last_block_hash + struct.pack("<I", i)).digest()
        for i in range(num_blocks)
    ]
