"""The block pool and KV cache manager, without a model."""

from __future__ import annotations

import pytest

from common.hashing import hash_blocks
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.recorder import EventRecorder


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=8),
        eos_token_ids=frozenset(),
        max_model_len=1024,
        cache_salt=salt,
    )


def test_allocate_free_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.num_free_blocks == 1
    pool.touch(a[:1])
    pool.free(a)
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free(a[:1])
    assert pool.leak_report() == []
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_lru_eviction_order_and_events():
    recorder = EventRecorder()
    pool = BlockPool(3, observers=[recorder])
    blocks = pool.allocate(3)
    hashes = [bytes([i]) * 32 for i in range(3)]
    pool.cache_blocks(blocks, hashes, None, list(range(3 * 4)), 4)
    assert recorder.stored == [hashes]
    pool.free([blocks[2], blocks[0], blocks[1]])  # block 2 freed first → evicted first
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    (taken,) = pool.allocate(1)
    assert taken is blocks[2] and taken.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert recorder.removed == [hashes[2]]
    # A cache hit takes a free block out of the free queue.
    pool.touch([pool.get_cached_block(hashes[0])])
    assert pool.num_free_blocks == 1
    pool.free([blocks[0], taken])
    assert pool.leak_report() == []


def test_prefix_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    kv.update_block_hashes(first)
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 12)
    second = make_request("b", list(range(12)))
    kv.update_block_hashes(second)
    hits, num_tokens = kv.get_computed_blocks(second)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit.
    assert num_tokens == 8 and [b.block_id for b in hits] == kv.get_block_ids("a")[:2]
    assert kv.allocate_slots(second, 4, hits)
    assert hits[0].ref_cnt == 2
    kv.free(first)
    kv.free(second)
    assert kv.leak_report() == []


def test_salted_requests_do_not_share():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(12)), salt="tenant-a")
    kv.update_block_hashes(a)
    assert kv.allocate_slots(a, 12)
    b = make_request("b", list(range(12)), salt="tenant-b")
    kv.update_block_hashes(b)
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)
    assert kv.leak_report() == []


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(12)))
    kv.update_block_hashes(a)
    assert kv.allocate_slots(a, 12)
    b = make_request("b", list(range(100, 112)))
    kv.update_block_hashes(b)
    assert not kv.allocate_slots(b, 12)
    assert kv.num_free_blocks == 1 and "b" not in kv.req_to_blocks
    kv.free(a)
    assert kv.leak_report() == []


def test_free_hits_count_against_capacity():
    """Cached blocks sitting in the free queue cannot be both reused and allocated."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(13)))
    kv.update_block_hashes(a)
    assert kv.allocate_slots(a, 13)  # 4 blocks, 3 of them full and cached
    kv.free(a)
    b = make_request("b", list(range(12)) + [99] * 9)
    kv.update_block_hashes(b)
    hits, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 12
    # 21 tokens need 6 blocks: 3 hits + 3 new, but only 1 free block is not a hit.
    assert not kv.allocate_slots(b, 9, hits)
    assert all(block.ref_cnt == 0 for block in hits)
    assert kv.leak_report() == []


def test_decode_blocks_are_cached_as_they_fill():
    recorder = EventRecorder()
    kv = KVCacheManager(num_blocks=8, block_size=4, observers=[recorder])
    a = make_request("a", list(range(6)))
    kv.update_block_hashes(a)
    assert kv.allocate_slots(a, 6)
    assert len(recorder.stored) == 1
    a.num_computed_tokens = 6
    a.append_output_token(50, None)
    a.append_output_token(51, None)
    kv.update_block_hashes(a)
    assert kv.allocate_slots(a, 2)
    assert recorder.stored[-1] == [hash_blocks([0, 1, 2, 3, 4, 5, 50, 51], 4)[1]]
    kv.free(a)
    assert kv.leak_report() == []
