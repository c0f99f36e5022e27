"""Layout, handshake envelope, config and registry: the checks that run before any byte moves."""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.config_base import ConfigError
from kv_transfer import (
    ConnectorName,
    HandshakeError,
    KVLayout,
    KVTransferConfig,
    LayoutMismatchError,
    create_connector,
)
from kv_transfer.handshake import (
    HANDSHAKE_VERSION,
    PeerMetadata,
    decode_peer_metadata,
    encode_metadata,
)
from kv_transfer.layout import KVCaches

LAYOUT = KVLayout(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")


def caches(num_layers=2, shape=(8, 2, 16, 4, 64), dtype=torch.bfloat16) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]


def test_layout_from_caches_and_sizes():
    kv = KVCaches.from_tensors(caches())
    assert kv.layout == LAYOUT and kv.num_blocks == 8
    assert LAYOUT.block_bytes_per_layer == 2 * 16 * 4 * 64 * 2
    assert LAYOUT.block_bytes == 2 * LAYOUT.block_bytes_per_layer


def block_major_views(num_layers=2, shape=(8, 2, 16, 4, 64), extra_layers=0):
    buffer = torch.zeros((shape[0], num_layers + extra_layers, *shape[1:]), dtype=torch.bfloat16)
    return [buffer[:, layer] for layer in range(num_layers)]


def test_separate_and_block_major_arrangements():
    separate = KVCaches.from_tensors(caches())
    assert not separate.block_major
    assert separate.block_stride_bytes == LAYOUT.block_bytes_per_layer
    assert separate.regions() == [
        (t.data_ptr(), 8 * LAYOUT.block_bytes_per_layer) for t in separate.tensors
    ]
    views = block_major_views()
    kv = KVCaches.from_tensors(views)
    assert kv.layout == LAYOUT and kv.num_blocks == 8  # peers see the same layout
    assert kv.block_major and kv.block_stride_bytes == LAYOUT.block_bytes
    assert kv.regions() == [(views[0].data_ptr(), 8 * LAYOUT.block_bytes)]


@pytest.mark.parametrize(
    "bad",
    [
        block_major_views()[::-1],  # layers out of order
        block_major_views(extra_layers=1),  # a gap between blocks
        block_major_views(shape=(8, 2, 16, 4, 64))[:1] + caches(1),  # half a buffer
    ],
)
def test_strided_caches_that_are_not_block_major_are_refused(bad):
    with pytest.raises(ValueError, match="views of one contiguous"):
        KVCaches.from_tensors(bad)


@pytest.mark.parametrize(
    "bad",
    [
        caches(shape=(8, 3, 16, 4, 64)),  # not K/V
        [*caches(1), torch.zeros(8, 2, 16, 4, 32, dtype=torch.bfloat16)],  # layers differ
        [torch.zeros(2, 8, 16, 4, 64, dtype=torch.bfloat16).transpose(0, 1)],  # strided
        [],
    ],
)
def test_invalid_caches_are_refused(bad):
    with pytest.raises(ValueError):
        KVCaches.from_tensors(bad)


def test_check_compatible_names_every_difference():
    other = msgspec.structs.replace(LAYOUT, dtype="float16", block_size=32)
    LAYOUT.check_compatible(msgspec.structs.replace(LAYOUT))
    with pytest.raises(LayoutMismatchError) as info:
        LAYOUT.check_compatible(other)
    assert set(info.value.mismatches) == {"dtype", "block_size"}
    assert info.value.mismatches["dtype"] == ("bfloat16", "float16")


def test_tensor_parallel_ranks_pair_only_with_the_same_rank_of_the_same_size(tmp_path):
    """A connector registered as rank 1 of 2 refuses a peer of another size or rank,
    before any byte moves; its shared-storage files live in its rank's own directory."""
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              tp_size=2, tp_rank=1)  # fmt: skip
    with create_connector(config, "engine-tp1") as connector:
        connector.register_kv_caches(caches())
        assert (connector.layout.tp_size, connector.layout.tp_rank) == (2, 1)
        assert connector.root.name.endswith("-tp1of2")
        ours = connector.metadata()
        decode_peer_metadata(ours, connector=ConnectorName.SHARED_STORAGE,
                             local_layout=connector.layout)  # fmt: skip
        for other in (LAYOUT, msgspec.structs.replace(connector.layout, tp_rank=0)):
            with pytest.raises(LayoutMismatchError) as info:
                decode_peer_metadata(ours, connector=ConnectorName.SHARED_STORAGE,
                                     local_layout=other)  # fmt: skip
            assert {"tp_size", "tp_rank"} & set(info.value.mismatches)
    with pytest.raises(ConfigError, match="tp_rank"):
        KVTransferConfig(tp_size=2, tp_rank=2)


def envelope(**overrides) -> bytes:
    fields = dict(
        version=HANDSHAKE_VERSION,
        connector="nixl",
        engine_id="prefill-0",
        layout=LAYOUT,
        num_blocks=100,
        transport=b"\x01",
    )
    return encode_metadata(PeerMetadata(**{**fields, **overrides}))


def test_envelope_round_trip():
    metadata = decode_peer_metadata(
        envelope(), connector=ConnectorName.NIXL, local_layout=LAYOUT, engine_id="prefill-0"
    )
    assert metadata.num_blocks == 100 and metadata.transport == b"\x01"


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\xc1garbage", HandshakeError),
        (envelope(version=HANDSHAKE_VERSION + 1), HandshakeError),
        (envelope(connector="nccl"), HandshakeError),
        (envelope(engine_id="prefill-1"), HandshakeError),  # a stale endpoint
        (envelope(layout=msgspec.structs.replace(LAYOUT, num_kv_heads=8)), LayoutMismatchError),
        (envelope(num_blocks=-1), HandshakeError),
        (envelope(num_blocks=2**30), HandshakeError),  # x 2 layers: past int32 descriptors
    ],
)
def test_bad_envelopes_are_refused(data, error):
    with pytest.raises(error):
        decode_peer_metadata(
            data, connector=ConnectorName.NIXL, local_layout=LAYOUT, engine_id="prefill-0"
        )


def test_config_validates_and_coerces():
    assert KVTransferConfig(connector="nccl").connector is ConnectorName.NCCL
    assert KVTransferConfig().host == "127.0.0.1"  # never every interface by default
    with pytest.raises(ConfigError, match="connector"):
        KVTransferConfig(connector="carrier-pigeon")
    with pytest.raises(ConfigError, match="shared_dir"):
        KVTransferConfig(connector="shared_storage")
    with pytest.raises(ConfigError, match="timeout_s"):
        KVTransferConfig(timeout_s=0)


def test_registry_builds_each_connector(tmp_path):
    for name in ConnectorName:
        config = KVTransferConfig(connector=name, shared_dir=str(tmp_path))
        connector = create_connector(config, f"engine-{name}")
        try:
            assert connector.name is name
            connector.register_kv_caches(caches())
            decode_peer_metadata(connector.metadata(), connector=name, local_layout=LAYOUT)
        finally:
            connector.close()


def test_misuse_raises_value_errors(tmp_path):
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path))
    with create_connector(config, "engine") as connector:
        connector.register_kv_caches(caches())
        h = [bytes(32)]
        with pytest.raises(ValueError, match="outside"):
            connector.export_blocks("t", [8], h)
        with pytest.raises(ValueError, match="block_hashes"):
            connector.export_blocks("t", [1])  # shared storage names blocks by hash
        connector.export_blocks("t", [1], h)
        with pytest.raises(ValueError, match="already active"):
            connector.export_blocks("t", [2], h)
        with pytest.raises(ValueError, match="remote block ids for"):
            connector.start_fetch("f", None, [1, 2], [3], None)  # type: ignore[arg-type]
