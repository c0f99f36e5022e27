"""The torch attention backend's batched paths (decodes, short segments) against the
per-segment reference, over batches that mix decodes, drafts being verified and prompt
chunks."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import BatchLayout, LayerSpec
from engine.attention.torch_backend import SHORT_QUERY_LEN, TorchAttentionBackend
from tests.kernels.paged_batch import make_batch

SEGMENTS = {
    # (query_len, seq_len), shortest first as the model runner orders them.
    "decodes+short": [(1, 9), (1, 40), (2, 2), (3, 17), (5, 33), (5, 64), (SHORT_QUERY_LEN, 50)],
    "short+long": [(2, 30), (4, 4), (7, 71), (SHORT_QUERY_LEN + 1, 80), (40, 100)],
    "all-kinds": [(1, 1), (1, 70), (2, 16), (4, 48), (6, 20), (30, 30), (50, 130)],
    "one-short": [(1, 5), (3, 21), (40, 90)],
}


def layout_of(batch, segments: list[tuple[int, int]]) -> BatchLayout:
    """The batch's layout, storing nothing (the cache is the batch's)."""
    starts = batch.query_start_loc.tolist()
    return BatchLayout(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        query_start_loc_cpu=starts,
        seq_lens_cpu=batch.seq_lens.tolist(),
        num_decodes=batch.num_decodes,
        max_query_len=max(q for q, _ in segments),
        max_seq_len=max(s for _, s in segments),
    )


@pytest.mark.parametrize("segments", SEGMENTS.values(), ids=SEGMENTS.keys())
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_batched_paths_match_the_reference(segments, heads, block_size, sliding_window):
    num_q_heads, num_kv_heads = heads
    batch = make_batch(
        segments, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=16,
        block_size=block_size, dtype=torch.float32, device=torch.device("cpu"), seed=3,
    )  # fmt: skip
    # Slots no segment owns hold garbage, as in a live cache (the kernel tests' NaN would
    # poison a masked SDPA too: 0 x NaN).
    kv_cache = torch.nan_to_num(batch.kv_cache, nan=1e3)
    starts = batch.query_start_loc.tolist()
    layout = layout_of(batch, segments)
    backend = TorchAttentionBackend(block_size)
    metadata = backend.build_metadata(layout)
    num_short = sum(1 for q, _ in segments[batch.num_decodes :] if q <= SHORT_QUERY_LEN)
    assert (metadata.short is not None) == (num_short >= 2)
    empty = torch.empty(starts[-1], num_kv_heads, 16)
    out = backend.forward(
        batch.query, empty, empty, kv_cache, metadata, LayerSpec(batch.scale, sliding_window)
    )
    batch = type(batch)(**{**{f: getattr(batch, f) for f in batch.__dataclass_fields__},
                           "kv_cache": kv_cache})  # fmt: skip
    torch.testing.assert_close(out, batch.expected(sliding_window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_nan_past_the_sequences_ends_stays_out_of_a_low_precision_cache(kv_dtype):
    """The padded paths read whole blocks, the slots past each sequence's end too: a
    16-bit or FP8 cache's garbage there (a hybrid model's state snapshot, float32 bytes,
    in a reused block) held NaNs the mask cannot keep out (NaN + -inf), and a Qwen3.5 on
    an FP8 cache answered token 0 with NaN log-probs. Here every slot no segment owns is
    NaN, in decodes and short segments both."""
    segments = SEGMENTS["decodes+short"]
    batch = make_batch(
        segments, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=16,
        dtype=torch.float32, device=torch.device("cpu"), seed=5, kv_dtype=kv_dtype,
    )  # fmt: skip
    assert batch.kv_cache.float().isnan().any()
    starts = batch.query_start_loc.tolist()
    layout = layout_of(batch, segments)
    backend = TorchAttentionBackend(16)
    metadata = backend.build_metadata(layout)
    assert metadata.short is not None and batch.num_decodes == 2
    empty = torch.empty(starts[-1], 2, 16)
    out = backend.forward(batch.query, empty, empty, batch.kv_cache, metadata,
                          LayerSpec(batch.scale, None))  # fmt: skip
    assert out.isfinite().all()
    torch.testing.assert_close(out, batch.expected(), atol=2e-5, rtol=2e-5)
