"""Plain-torch versions of the KV kernels: the test oracles, and the engine's torch backend.

KV cache layout, one tensor per layer (see DESIGN.md):

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]    (index 0 = K, 1 = V)

A *slot* is ``block_id * block_size + offset``. A flattened batch holds ``num_seqs`` query
segments back to back; segment ``i`` owns query rows ``query_start_loc[i] :
query_start_loc[i + 1]``, which are the *last* ``query_len`` tokens of a context of
``seq_lens[i]`` tokens whose blocks are ``block_table[i]``. Query token ``j`` of a segment
sits at position ``seq_len - query_len + j`` and attends causally to every earlier context
token (or only the last ``sliding_window`` of them, itself included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot means "skip"
) -> None:
    """Write each token's K and V into its slot."""
    if slot_mapping.numel() == 0:
        return
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = value.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` keys and values of a sequence: two [num_tokens, H, D]."""
    blocks = kv_cache.index_select(0, block_ids)  # [n, 2, block_size, H, D]
    num_heads, head_dim = blocks.shape[-2:]
    key = blocks[:, 0].reshape(-1, num_heads, head_dim)[:num_tokens]
    value = blocks[:, 1].reshape(-1, num_heads, head_dim)[:num_tokens]
    return key, value


def causal_mask(
    query_len: int,
    seq_len: int,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query j may attend key k."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _attend(
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, D]
    mask: torch.Tensor,  # bool, broadcastable to [B, Hq, Lq, Lk]
    scale: float,
) -> torch.Tensor:
    num_groups = query.shape[1] // key.shape[1]
    if num_groups > 1:
        key = key.repeat_interleave(num_groups, dim=1)
        value = value.repeat_interleave(num_groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Attention of every query segment over its paged context, one segment at a time."""
    out = torch.zeros_like(query)
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0 or seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        key, value = gather_kv(kv_cache, block_table[i, :num_blocks].long(), seq_len)
        mask = causal_mask(query_len, seq_len, sliding_window, query.device)
        seg = _attend(
            query[q_start:q_end].transpose(0, 1)[None],  # [1, Hq, Lq, D]
            key.transpose(0, 1)[None].to(query.dtype),  # [1, Hkv, Lk, D]
            value.transpose(0, 1)[None].to(query.dtype),
            mask,
            scale,
        )
        out[q_start:q_end] = seg[0].transpose(0, 1)
    return out


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Single-token queries for many sequences in one batched call (padded to the longest)."""
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return query.clone()
    block_size = kv_cache.shape[2]
    max_seq_len = int(seq_lens.max())
    max_blocks = -(-max_seq_len // block_size)
    blocks = kv_cache[block_table[:, :max_blocks].long()]  # [B, nb, 2, bs, Hkv, D]
    num_kv_heads, head_dim = blocks.shape[-2:]
    key = blocks[:, :, 0].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    value = blocks[:, :, 1].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    k_pos = torch.arange(key.shape[2], device=query.device)[None, :]
    last = (seq_lens.to(query.device).long() - 1)[:, None]
    mask = k_pos <= last
    if sliding_window is not None:
        mask &= k_pos > last - sliding_window
    out = _attend(
        query[:, :, None, :],  # [B, Hq, 1, D]
        key.to(query.dtype),
        value.to(query.dtype),
        mask[:, None, None, :],  # [B, 1, 1, Lk]
        scale,
    )
    return out[:, :, 0, :]


def gather_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int64
    out: torch.Tensor | None = None,  # [n, 2, block_size, H, D]
) -> torch.Tensor:
    """Copy blocks out of the paged cache into one contiguous staging tensor."""
    if out is None:
        return kv_cache.index_select(0, block_ids.to(kv_cache.device))
    torch.index_select(kv_cache, 0, block_ids.to(kv_cache.device), out=out)
    return out


def scatter_blocks(
    staging: torch.Tensor,  # [n, 2, block_size, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, H, D]
    block_ids: torch.Tensor,  # [n] int64
) -> None:
    """Copy a contiguous staging tensor into the given blocks of the paged cache."""
    kv_cache.index_copy_(0, block_ids.to(kv_cache.device), staging.to(kv_cache.dtype))
