"""KV events from a real engine: what is cached is announced, what is evicted is retracted."""

from __future__ import annotations

from common.engine_config import EngineConfig
from common.hashing import hash_blocks
from common.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Medium,
    decode_batch,
    encode_batch,
)
from engine import LLMEngine, SamplingParams
from engine.kv_events import KVEventCollector


def test_engine_events_follow_the_prefix_cache(tiny_llama):
    collector = KVEventCollector()
    engine = LLMEngine(tiny_llama, EngineConfig(num_blocks=16, max_model_len=128), [collector])
    prompt = list(range(10, 10 + 40))  # 2 full blocks + 8 tokens
    engine.add_request("a", prompt, SamplingParams(max_tokens=30, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    events = collector.drain()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    # 40 prompt + 30 output tokens (the last one never fed back): 69 tokens, 4 full blocks.
    assert stored[:2] == hash_blocks(prompt, 16)
    assert len(stored) == 4
    first = events[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    # (not the prompt's tokens: the events port would show every cached prompt)
    assert first.token_ids == [] and first.medium is Medium.GPU
    # Fill the pool with other prompts: the first request's blocks get evicted.
    for i in range(3):
        other = list(range(1000 + 100 * i, 1000 + 100 * i + 70))
        engine.add_request(f"b{i}", other, SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    removed = [h for e in collector.drain() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(stored) & set(removed)
    assert engine.leak_report() == []
    # A reset retracts the pool's blocks one by one: AllBlocksCleared said every tier was
    # gone, and the router dropped a CPU tier's blocks, which the tier keeps.
    cached = set(engine.scheduler.kv.pool.cached_blocks)
    assert cached and engine.scheduler.kv.pool.reset_prefix_cache()
    (reset,) = collector.drain()
    assert isinstance(reset, BlockRemoved) and reset.medium is Medium.GPU
    assert set(reset.block_hashes) == cached


def test_event_batches_round_trip_through_msgpack():
    batch = KVEventBatch(
        seq=7,
        ts=1.5,
        events=[
            BlockStored([b"\x01" * 32], None, list(range(16)), 16, Medium.CPU),
            BlockRemoved([b"\x02" * 32]),
        ],
    )
    assert decode_batch(encode_batch(batch)) == batch
