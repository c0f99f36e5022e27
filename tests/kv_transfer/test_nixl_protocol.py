"""The NIXL handshake section across versions, and the two descriptor granularities."""

from __future__ import annotations

import msgspec
import numpy as np

from kv_transfer.nixl_protocol import (
    NixlPayload,
    desc_indices,
    is_block_major,
    layer_block_descs,
    whole_block_descs,
)

CHUNK = 1024  # one layer's block, bytes
LAYERS = 3


class PayloadBeforeBlockStride(msgspec.Struct, frozen=True, kw_only=True):
    """``NixlPayload`` as peers from before block-major caches decode it."""

    agent_metadata: bytes
    mem_type: str
    device_id: int
    base_addrs: list[int]


def payload(layer_addrs: list[int], block_stride: int) -> bytes:
    return msgspec.msgpack.encode(
        NixlPayload.for_caches(b"agent", "DRAM", 0, layer_addrs, block_stride, CHUNK)
    )


def test_older_peers_refuse_strided_layers_and_read_contiguous_ones():
    block_major = [4096 + layer * CHUNK for layer in range(LAYERS)]
    old_view = msgspec.msgpack.decode(
        payload(block_major, LAYERS * CHUNK), type=PayloadBeforeBlockStride
    )
    # An older peer checks len(base_addrs) == num_layers: it refuses instead of misreading.
    assert old_view.base_addrs == []
    separate = [4096, 1 << 20, 1 << 24]
    old_view = msgspec.msgpack.decode(payload(separate, CHUNK), type=PayloadBeforeBlockStride)
    assert old_view.base_addrs == separate  # the old meaning holds: stride = one layer's block


def test_addressing_from_new_and_older_peers():
    block_major = [4096 + layer * CHUNK for layer in range(LAYERS)]
    new = msgspec.msgpack.decode(payload(block_major, LAYERS * CHUNK), type=NixlPayload)
    assert new.layer_addressing(CHUNK) == (block_major, LAYERS * CHUNK)
    older = msgspec.msgpack.encode(
        PayloadBeforeBlockStride(
            agent_metadata=b"a", mem_type="DRAM", device_id=0, base_addrs=[1, 2, 3]
        )
    )
    assert msgspec.msgpack.decode(older, type=NixlPayload).layer_addressing(CHUNK) == (
        [1, 2, 3],
        CHUNK,
    )


def test_whole_block_descriptors_cover_the_layer_descriptors():
    num_blocks, base = 5, 1 << 16
    addrs = [base + layer * CHUNK for layer in range(LAYERS)]
    stride = LAYERS * CHUNK
    assert is_block_major(addrs, stride, CHUNK)
    assert not is_block_major(addrs[::-1], stride, CHUNK)
    assert not is_block_major(addrs, stride + CHUNK, CHUNK)  # a gap between blocks
    layer = layer_block_descs(addrs, num_blocks, CHUNK, stride, 0)
    whole = whole_block_descs(base, num_blocks, LAYERS * CHUNK, 0)
    for block in range(num_blocks):
        ids = desc_indices((block,), LAYERS, num_blocks, whole_blocks=False)
        runs = layer[ids]  # the block's layers, in order, end to end
        assert np.array_equal(runs[:, 0], whole[block, 0] + CHUNK * np.arange(LAYERS))
        assert (runs[:, 1] == CHUNK).all() and whole[block, 1] == LAYERS * CHUNK
    assert desc_indices((4, 1), LAYERS, num_blocks, whole_blocks=True).tolist() == [4, 1]
    assert desc_indices((4, 1), LAYERS, num_blocks, whole_blocks=False).tolist() == [
        4, 1, 9, 6, 14, 11,
    ]  # fmt: skip
