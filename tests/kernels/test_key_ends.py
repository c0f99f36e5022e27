"""Key ends (Gemma 3's images): a query row sees the keys below its key end, so the tokens of
one image see each other both ways while the rest stays causal, and a sliding window stays a
lower bound only. The reference against a brute-force mask, the Triton kernel against the
reference, and causal key ends against no key ends, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention_config import LaunchConfig
from kernels.paged_attention import paged_attention
from tests.kernels.paged_batch import TOLERANCES, PagedBatch, make_batch, poisoned_out
from tests.kernels.triton_env import DEVICE

# (segment, first position, end position) of each image: its tokens' key end is its end.
Image = tuple[int, int, int]


def image_segments(block_size: int) -> tuple[list[tuple[int, int]], list[Image]]:
    """Three decodes, then: a fresh prompt with an image across the first tile / block edge
    and one ending at the segment's end; a chunk on a cached prefix whose first image began
    in the prefix (its cached tokens are not queried, its key end is still the image's end)
    and whose second ends inside the chunk; a one-token chunk; a segment without rows."""
    segments = [(1, 1), (1, 37), (1, 2 * block_size), (40, 40), (24, 50), (1, 20), (0, 9)]
    images = [(3, 5, 21), (3, 30, 40), (4, 20, 35), (4, 38, 47)]
    return segments, images


def key_ends_of(batch: PagedBatch, images: list[Image]) -> torch.Tensor:  # [num_tokens] int32
    """Position + 1 for every row, the image's end for the rows inside an image."""
    pos = batch.positions().cpu()
    key_ends = pos + 1
    starts = batch.query_start_loc.tolist()
    for seg, first, end in images:
        rows = slice(starts[seg], starts[seg + 1])
        inside = (pos[rows] >= first) & (pos[rows] < end)
        key_ends[rows] = torch.where(inside, end, key_ends[rows])
    return key_ends.to(torch.int32).to(batch.query.device)


def batch_with_images(
    block_size: int, group: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[PagedBatch, torch.Tensor]:
    segments, images = image_segments(block_size)
    batch = make_batch(
        segments, num_q_heads=2 * group, num_kv_heads=2, head_dim=32, block_size=block_size,
        dtype=dtype, device=DEVICE, seed=seed,
    )  # fmt: skip
    assert batch.num_decodes == 3
    return batch, key_ends_of(batch, images)


def brute_force(
    batch: PagedBatch,
    key_ends: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim] fp32
    """Dense softmax per row and head over keys read slot by slot through the block table,
    masked by the rule itself: k < key_end and k > position - window."""
    cache, table = batch.kv_cache.float().cpu(), batch.block_table.cpu()
    block_size = cache.shape[2]
    group = batch.query.shape[1] // cache.shape[3]
    positions, key_ends = batch.positions().tolist(), key_ends.tolist()
    starts = batch.query_start_loc.tolist()
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    for seg, seq_len in enumerate(batch.seq_lens.tolist()):
        slots = [(int(table[seg, k // block_size]), k % block_size) for k in range(seq_len)]
        keys = torch.stack([cache[b, 0, o] for b, o in slots]) if slots else None  # [Lk, Hkv, D]
        values = torch.stack([cache[b, 1, o] for b, o in slots]) if slots else None
        for row in range(starts[seg], starts[seg + 1]):
            pos, end = positions[row], key_ends[row]
            visible = torch.tensor(
                [k < end and (window is None or k > pos - window) for k in range(seq_len)]
            )
            for head in range(batch.query.shape[1]):
                q = batch.query[row, head].float().cpu()
                scores = keys[:, head // group] @ q * batch.scale  # [Lk]
                scores = scores.masked_fill(~visible, float("-inf"))
                if sinks is not None:
                    scores = torch.cat((scores, sinks[head].float().cpu().view(1)))
                probs = scores.softmax(0)[:seq_len]
                out[row, head] = probs @ values[:, head // group]
    return out.to(batch.query.device)


def run(batch: PagedBatch, num_decodes: int, window: int | None = None, **kw) -> torch.Tensor:
    out = poisoned_out(batch)
    paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
        batch.scale, window, num_decodes=num_decodes, out=out, **kw,
    )  # fmt: skip
    return out


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any(), "a row was not written (or a poisoned slot was read)"
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[out.dtype])


@pytest.mark.parametrize("window", [None, 4, 24])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_matches_brute_force(window, with_sinks):
    batch, key_ends = batch_with_images(16, group=2)
    sinks = torch.linspace(-3.0, 3.0, 4).to(DEVICE) if with_sinks else None
    expected = brute_force(batch, key_ends, window, sinks)
    torch.testing.assert_close(batch.expected(window, sinks, key_ends), expected)


@pytest.mark.parametrize("window", [None, 4, 24])  # 4: smaller than an image
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_matches_reference(group, block_size, window):
    """The tuned launches (decodes apart), and every segment in the prefill launch with
    q blocks of 4 or 16 tokens and 16-key tiles: images cross tiles, blocks and q blocks."""
    batch, key_ends = batch_with_images(block_size, group, seed=block_size + group)
    expected = batch.expected(window, key_ends=key_ends)
    check(run(batch, 3, window, key_ends=key_ends), expected)
    small = LaunchConfig(block_m=16, tile_n=16)
    check(run(batch, 0, window, key_ends=key_ends, prefill=small), expected)


@pytest.mark.parametrize(
    ("dtype", "window", "with_sinks"),
    [
        (torch.float32, 4, True),
        (torch.float16, None, False),
        (torch.bfloat16, 24, True),
    ],
)
def test_dtypes_and_sinks(dtype, window, with_sinks):
    batch, key_ends = batch_with_images(16, group=4, dtype=dtype, seed=7)
    sinks = torch.linspace(-4.0, 4.0, 8).to(DEVICE, dtype) if with_sinks else None
    expected = batch.expected(window, sinks, key_ends)
    small = LaunchConfig(block_m=16, tile_n=16)
    check(run(batch, 3, window, sinks=sinks, key_ends=key_ends, prefill=small), expected)


@pytest.mark.parametrize("window", [None, 4])
def test_causal_key_ends_are_no_key_ends(window):
    """Key ends of position + 1 everywhere change nothing, bit for bit."""
    batch, _ = batch_with_images(16, group=4)
    causal = (batch.positions() + 1).to(torch.int32)
    ref = batch.expected(window)
    assert torch.equal(batch.expected(window, key_ends=causal), ref)
    for num_decodes, options in ((3, {}), (0, {"prefill": LaunchConfig(16, 16)})):
        plain = run(batch, num_decodes, window, **options)
        assert torch.equal(run(batch, num_decodes, window, key_ends=causal, **options), plain)


def test_image_rows_see_later_tokens():
    """Every image row but each image's last differs from causal attention (a kernel that
    ignored key ends would pass the other tests only where they are causal); the others
    match it."""
    batch, key_ends = batch_with_images(16, group=4)
    looks_ahead = key_ends.long() > batch.positions() + 1
    assert int(looks_ahead.sum()) == 15 + 9 + 8 + 8
    causal = run(batch, 3)
    out = run(batch, 3, key_ends=key_ends)
    row_diff = (out - causal).abs().amax(dim=(1, 2))  # [num_tokens]
    assert bool((row_diff[looks_ahead] > 1e-3).all())
    assert torch.equal(out[~looks_ahead], causal[~looks_ahead])


def test_bad_key_ends():
    batch, key_ends = batch_with_images(16, group=1)
    for bad in (
        key_ends[:-1],  # a row short
        key_ends[:, None],  # 2-D
        key_ends.long(),
        key_ends.float(),
    ):
        with pytest.raises(ValueError, match="key_ends"):
            run(batch, 3, key_ends=bad)
    with pytest.raises(ValueError, match="key_ends"):
        batch.expected(key_ends=key_ends[1:])
