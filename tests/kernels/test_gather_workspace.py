"""The padded K/V gather of the torch backend's batched paths, into reused buffers
(``GatherWorkspace``): the same tensors as a fresh gather, the buffers kept across calls,
grown by doubling, per cache shape, and a padded gather past the pool left unkept."""

from __future__ import annotations

import torch

from kernels.reference import GatherWorkspace, _padded_kv


def cache_and_table(num_blocks: int, num_seqs: int, max_blocks: int, heads: int = 2,
                    head_dim: int = 8, seed: int = 0):  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(num_blocks, 2, 16, heads, head_dim, generator=generator)
    table = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=generator)
    return kv_cache, table.int()


def gathered(kv_cache, seq_lens, table, workspace=None):
    key, value = _padded_kv(kv_cache, torch.tensor(seq_lens), table, workspace)
    return key.clone(), value.clone(), key.untyped_storage().data_ptr()


def test_the_same_tensors_as_a_fresh_gather_in_kept_buffers():
    kv_cache, table = cache_and_table(num_blocks=64, num_seqs=4, max_blocks=8)
    workspace = GatherWorkspace()
    pointers = []
    # 4 x 3 blocks, then 4 x 8 (grown to 32), then 4 x 5 (fits: kept), then 3 x 8 (kept).
    for seq_lens, rows in (([40, 33, 17, 5], 4), ([128, 100, 120, 1], 4),
                           ([70, 80, 65, 3], 4), ([128, 127, 126], 3)):  # fmt: skip
        fresh_key, fresh_value, _ = gathered(kv_cache, seq_lens, table[:rows])
        key, value, pointer = gathered(kv_cache, seq_lens, table[:rows], workspace)
        assert torch.equal(key, fresh_key) and torch.equal(value, fresh_value)
        ((held_key, _),) = workspace._buffers.values()
        assert pointer == held_key.untyped_storage().data_ptr()  # gathered into the buffer
        pointers.append(pointer)
    assert pointers[1] == pointers[2] == pointers[3] != pointers[0]
    ((held_key, held_value),) = workspace._buffers.values()
    assert held_key.shape == held_value.shape == (32, 16, 2, 8)  # max(32, 2 x 12)


def test_growth_doubles_up_to_the_pool():
    kv_cache, _ = cache_and_table(num_blocks=20, num_seqs=2, max_blocks=10)
    workspace = GatherWorkspace()
    workspace.take(kv_cache, 6)
    workspace.take(kv_cache, 7)  # doubled: 12
    assert next(iter(workspace._buffers.values()))[0].shape[0] == 12
    workspace.take(kv_cache, 13)  # 24 would pass the pool's 20
    assert next(iter(workspace._buffers.values()))[0].shape[0] == 20


def test_a_padded_gather_past_the_pool_is_fresh_and_not_kept():
    """3 sequences padded to 8 blocks each need 24 blocks of a 16-block pool."""
    kv_cache, table = cache_and_table(num_blocks=16, num_seqs=3, max_blocks=8)
    workspace = GatherWorkspace()
    fresh_key, fresh_value, _ = gathered(kv_cache, [128, 5, 9], table)
    key, value, _ = gathered(kv_cache, [128, 5, 9], table, workspace)
    assert torch.equal(key, fresh_key) and torch.equal(value, fresh_value)
    assert workspace.take(kv_cache, 24) is None and not workspace._buffers


def test_each_cache_shape_and_dtype_has_its_own_buffers():
    """Layers of another head layout (or a cast cache) do not overwrite a gather."""
    small, small_table = cache_and_table(num_blocks=32, num_seqs=2, max_blocks=4)
    wide, wide_table = cache_and_table(num_blocks=32, num_seqs=2, max_blocks=4, heads=4)
    workspace = GatherWorkspace()
    key, _ = _padded_kv(small, torch.tensor([64, 64]), small_table, workspace)
    before = key.clone()
    _padded_kv(wide, torch.tensor([64, 64]), wide_table, workspace)
    _padded_kv(small.half(), torch.tensor([64, 64]), small_table, workspace)
    assert torch.equal(key, before)
    assert len(workspace._buffers) == 3
