"""The Triton paged-attention kernel against ``kernels.reference`` (fp32 oracle).

On CPU the kernels run in Triton's interpreter, so shapes stay small; the ``gpu`` tests add
long contexts and production head counts.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.attention_config import LaunchConfig
from kernels.paged_attention import decode_attention, paged_attention
from tests.kernels.paged_batch import TOLERANCES, PagedBatch, make_batch, poisoned_out
from tests.kernels.triton_env import DEVICE


def mixed_segments(block_size: int) -> list[tuple[int, int]]:
    """Decodes first (a first token, mid-block, block-aligned), then prompt chunks: a fresh
    prompt with a partial last block, a chunk on a cached prefix that ends mid-block, a
    one-token chunk in the prefill launch, and a segment with no query rows."""
    return [
        (1, 1),
        (1, 37),
        (1, 2 * block_size),
        (block_size + 3, block_size + 3),
        (7, 2 * block_size + 11),
        (1, 20),
        (0, 9),
    ]


def run(batch: PagedBatch, num_decodes: int, sliding_window: int | None = None, **kw):
    out = poisoned_out(batch)
    paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        batch.scale,
        sliding_window,
        num_decodes=num_decodes,
        out=out,
        **kw,
    )
    return out


def check(
    out: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    assert not out.isnan().any(), "a row was not written (or a poisoned slot was read)"
    expected = batch.expected(sliding_window, sinks)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(block_size, group):
    batch = make_batch(
        mixed_segments(block_size),
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        device=DEVICE,
        seed=block_size + group,
    )
    assert batch.num_decodes == 3
    check(run(batch, num_decodes=3), batch)  # decode launch + prefill launch
    check(run(batch, num_decodes=0), batch)  # everything in the prefill launch


@pytest.mark.parametrize(
    ("dtype", "head_dim", "segments"),
    [
        (torch.float16, 64, [(1, 40), (1, 17), (12, 30), (5, 5)]),
        (torch.float16, 128, [(1, 40), (9, 25)]),
        (torch.bfloat16, 64, [(1, 23), (6, 20)]),
        (torch.bfloat16, 128, [(1, 18), (3, 19)]),
        (torch.float32, 128, [(1, 40), (9, 25)]),
        (torch.float32, 80, [(1, 33), (4, 21)]),  # head_dim not a power of two
    ],
)
def test_dtypes_and_head_dims(dtype, head_dim, segments):
    batch = make_batch(
        segments,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
    )
    check(run(batch, num_decodes=batch.num_decodes), batch)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)],
)
def test_fp8_kv_cache(dtype, kv_dtype):
    """``engine.kv_cache_dtype: fp8``: the kernel reads FP8 keys and values and computes in
    the query's dtype, as the reference does with the same cache; split decodes too."""
    batch = make_batch(
        mixed_segments(16),
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        kv_dtype=kv_dtype,
    )
    assert batch.kv_cache.dtype == kv_dtype
    check(run(batch, num_decodes=3), batch)
    check(run(batch, num_decodes=3, num_splits=4), batch)


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
def test_split_kv_decode(num_splits):
    """16 splits over at most 5 tiles: most splits are empty and must weigh nothing."""
    batch = make_batch(
        [(1, 1), (1, 70), (1, 150), (1, 33)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
        seed=num_splits,
    )
    out = run(batch, num_decodes=4, num_splits=num_splits, decode=LaunchConfig(16, 32))
    check(out, batch)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window(window):
    batch = make_batch(
        [(1, 3), (1, 45), (1, 100), (30, 30), (17, 75)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
        seed=window,
    )
    small = {"decode": LaunchConfig(16, 16), "prefill": LaunchConfig(32, 16)}
    check(run(batch, 3, window, num_splits=2, **small), batch, window)
    check(run(batch, 0, window), batch, window)


def _sink_oracle(batch: PagedBatch, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """transformers' GPT-OSS eager attention, segment by segment: the sink is one more
    logit in each row's softmax, dropped before the values."""
    out = torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    starts = batch.query_start_loc.tolist()
    group = batch.query.shape[1] // batch.kv_cache.shape[3]
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.query[starts[i] : starts[i + 1]].float().transpose(0, 1)  # [Hq, Lq, D]
        if q.shape[1] == 0 or seq_len == 0:
            continue
        blocks = batch.block_table[i, : -(-seq_len // batch.kv_cache.shape[2])].long()
        k, v = reference.gather_kv(batch.kv_cache.float(), blocks, seq_len)  # [Lk, Hkv, D]
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, Lk, D]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        allowed = reference.causal_mask(q.shape[1], seq_len, window, q.device)
        scores = (q @ k.transpose(1, 2)) * batch.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = sinks.float()[:, None, None].expand(-1, q.shape[1], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
        out[starts[i] : starts[i + 1]] = (probs @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("dtype", "group", "window", "num_splits"),
    [
        (torch.float32, 1, None, 1),
        (torch.float32, 4, None, 4),
        (torch.float32, 8, 20, 2),
        (torch.bfloat16, 4, 20, 1),
    ],
)
def test_attention_sinks(dtype, group, window, num_splits):
    """GPT-OSS's sinks: the reference equals transformers' formula, and the kernel the
    reference, in the decode launch (split: the sink joins once) and the prefill launch.
    Sinks span large positive and negative logits: most or almost none of a row's weight."""
    batch = make_batch(
        [(1, 1), (1, 45), (1, 100), (30, 30), (17, 75), (0, 9)],
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        seed=group,
    )
    sinks = torch.linspace(-6.0, 6.0, 2 * group).to(DEVICE, dtype)
    torch.testing.assert_close(batch.expected(window, sinks), _sink_oracle(batch, window, sinks))
    split = {"decode": LaunchConfig(16, 16), "num_splits": num_splits}
    check(run(batch, batch.num_decodes, window, sinks=sinks, **split), batch, window, sinks)
    check(run(batch, 0, window, sinks=sinks), batch, window, sinks)
    # The sinks matter: without them the output differs.
    plain = run(batch, batch.num_decodes, window)
    assert not torch.allclose(plain.float(), batch.expected(window, sinks), atol=1e-2)


def test_small_tiles_and_rows():
    """Tiles smaller than a block, and q blocks of two tokens (block_m 16, group 8)."""
    batch = make_batch(
        mixed_segments(32),
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=64,
        block_size=32,
        dtype=torch.float32,
        device=DEVICE,
    )
    config = LaunchConfig(block_m=16, tile_n=16)
    check(run(batch, 3, decode=config, prefill=config, num_splits=4), batch)


def test_deep_prefill_shape():
    """The long-prompt shape of Hopper-class GPUs (256 rows: 64 tokens x a group of 4, 64-key
    tiles): q blocks of 64 tokens, cut by segment ends, beside decodes and cached prefixes."""
    batch = make_batch(
        [(1, 30), (1, 77), (150, 200), (64, 64), (3, 130), (65, 65)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
    )
    deep = LaunchConfig(block_m=256, tile_n=64, num_warps=8, num_stages=4)
    check(run(batch, 2, prefill=deep), batch)
    check(run(batch, 2, prefill=deep, sliding_window=40), batch, 40)


def test_degenerate_batches():
    heads = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
    # No segments, no tokens.
    empty = make_batch([], dtype=torch.float32, device=DEVICE, **heads)
    assert run(empty, 0).shape == (0, 4, 64)
    # Segments without query rows only.
    idle = make_batch([(0, 5), (0, 0)], dtype=torch.float32, device=DEVICE, **heads)
    assert run(idle, 0).shape == (0, 4, 64)
    # A context of zero tokens gives zeros, like the reference.
    zero = make_batch([(1, 0), (2, 0)], dtype=torch.float32, device=DEVICE, **heads)
    out = run(zero, 1, num_splits=2)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(out, zero.expected())
    # One single decode, one single-token prompt.
    one = make_batch([(1, 1)], dtype=torch.float32, device=DEVICE, **heads)
    check(run(one, 1), one)
    check(run(one, 0), one)


def test_decode_attention_matches_reference_decode():
    batch = make_batch(
        [(1, 5), (1, 64), (1, 99)],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=32,
        dtype=torch.float32,
        device=DEVICE,
    )
    # reference.decode_attention pads to the longest context: NaN padding would poison it.
    kv_cache = batch.kv_cache.nan_to_num(0.0)
    args = (batch.query, kv_cache, batch.seq_lens, batch.block_table, batch.scale)
    expected = reference.decode_attention(*args, sliding_window=20)
    torch.testing.assert_close(decode_attention(*args, sliding_window=20), expected)
    expected = reference.decode_attention(*args)
    torch.testing.assert_close(decode_attention(*args, max_seq_len=99, num_splits=2), expected)


def test_bad_arguments():
    batch = make_batch(
        [(1, 4)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=DEVICE,
    )  # fmt: skip
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens)
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(batch.query[:, :3], *args[1:], batch.block_table, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(*args, batch.block_table, 1.0, num_decodes=1, num_splits=3)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(*args, batch.block_table, 1.0, 0)
    with pytest.raises(ValueError, match="block_m"):
        LaunchConfig(block_m=8, tile_n=16)
    for out in (
        torch.empty(batch.query.shape[0], 4, 32),  # head_dim short
        torch.empty(batch.query.shape[0] - 1, 4, 64),  # a token short
        torch.empty(batch.query.shape[0], 64, 4).transpose(1, 2),  # head_dim strided
    ):
        with pytest.raises(ValueError, match="must have the query's shape"):
            paged_attention(*args, batch.block_table, 1.0, out=out.to(DEVICE))
    # A fuzz found these accepted: an integer out truncated the results, an int8 cache
    # was read as plain integers.
    int_out = torch.empty(batch.query.shape, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="out must have the query's dtype"):
        paged_attention(*args, batch.block_table, 1.0, out=int_out)
    with pytest.raises(TypeError, match="kv_cache must be a float"):
        paged_attention(batch.query, batch.kv_cache.to(torch.int8), *args[2:],
                        batch.block_table, 1.0)  # fmt: skip


def test_strided_metadata_views_and_tiny_heads():
    """Index tensors given as strided views read right (the kernels index them with
    stride 1); head sizes below tl.dot's minimum K are padded."""
    batch = make_batch(
        [(1, 9), (1, 33), (6, 20)], num_q_heads=4, num_kv_heads=2, head_dim=8,
        block_size=16, dtype=torch.float32, device=DEVICE,
    )  # fmt: skip

    def strided(t: torch.Tensor) -> torch.Tensor:  # same values, every other element
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]

    out = poisoned_out(batch)
    paged_attention(
        batch.query, batch.kv_cache, strided(batch.query_start_loc), strided(batch.seq_lens),
        strided(batch.block_table), batch.scale, num_decodes=2, out=out,
    )  # fmt: skip
    check(out, batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64])
def test_long_contexts_gpu(dtype, block_size):
    """Production shapes: 32 query heads over 8 KV heads of dim 128, 4k-token contexts,
    a 1k-token chunk on a 3k cached prefix, a 2.1k-token chunk (over 2k prefill rows: the
    default launch shape of GPUs with ~200 KB of shared memory), decodes on the split-KV
    path."""
    segments = [(1, 4099), (1, 1000), (1, 17), (1, 2048), (1024, 3000), (300, 300)]
    segments.append((2100, 2500))  # >= 2k prefill rows: the deep shape on Hopper-class GPUs
    batch = make_batch(
        segments,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
    )
    check(run(batch, num_decodes=4), batch)
    check(run(batch, num_decodes=4, sliding_window=1000), batch, 1000)
    check(run(batch, num_decodes=0), batch)
