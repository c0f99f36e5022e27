"""Plain-torch versions of the kernels: the test oracles, and the engine's torch backend.

Also ``moe_experts``, the mixture-of-experts MLP (``fused_moe.py``'s twin) that MoE models
run off the triton backend.

KV cache layout, one tensor per layer (see DESIGN.md):

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]    (index 0 = K, 1 = V)

A *slot* is ``block_id * block_size + offset``. A flattened batch holds ``num_seqs`` query
segments back to back; segment ``i`` owns query rows ``query_start_loc[i] :
query_start_loc[i + 1]``, which are the *last* ``query_len`` tokens of a context of
``seq_lens[i]`` tokens whose blocks are ``block_table[i]``. Query token ``j`` of a segment
sits at position ``seq_len - query_len + j`` and attends causally to every earlier context
token (or only the last ``sliding_window`` of them, itself included).

*Key ends* (Gemma 3's images, whose tokens see each other both ways): an optional
``[num_tokens]`` integer tensor giving each query row the exclusive end of the positions it
may attend to, ``position + 1 <= key_end <= seq_len`` (causal: ``position + 1``; a token of
an image: the image's end). Key ``k`` is then visible iff ``k < key_end`` and, with a
window, ``k > position - sliding_window``: the window stays a lower bound only.

With ``latent_dim`` (DeepSeek's latent attention) the K and V slots hold two halves of one
latent vector per token: the attention functions then take the whole latent as the key
(the query is as wide: absorbed) and its first ``latent_dim`` elements as the value;
``expanded_latent_attention`` expands a segment's latents to per-head keys and values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# KV cache dtypes of ``engine.kv_cache_dtype: fp8*``: stored unscaled, read back with
# ``.to(query.dtype)`` like any other cache dtype.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    kv_cache[block_ids, 0, offsets] = to_cache_dtype(key, kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = to_cache_dtype(value, kv_cache.dtype)


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as the cache stores them: FP8 saturates at the format's largest finite
    value (torch's conversion does for e4m3 but turns e5m2 overflow into inf, which an
    attention row then turns into NaN or zeros)."""
    if dtype in FP8_DTYPES:
        largest = torch.finfo(dtype).max
        values = values.clamp(-largest, largest)
    return values.to(dtype)


def gather_kv(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # two [n, block_size, H, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` keys and values of a sequence: two [num_tokens, H, D]
    (views of ``out`` when given: ``GatherWorkspace``'s buffers)."""
    num_heads, head_dim = kv_cache.shape[-2:]
    # Indexing the K (or V) view yields a contiguous [n, block_size, H, D]: one copy, and
    # the reshape below is free.
    key_out, value_out = (None, None) if out is None else out
    key = torch.index_select(kv_cache[:, 0], 0, block_ids, out=key_out)
    value = torch.index_select(kv_cache[:, 1], 0, block_ids, out=value_out)
    key, value = key.reshape(-1, num_heads, head_dim), value.reshape(-1, num_heads, head_dim)
    return key[:num_tokens], value[:num_tokens]


def latent_kv(
    key: torch.Tensor,  # [..., D]: the K slots' values
    value: torch.Tensor,  # [..., D]: the V slots'
    latent_dim: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as attention reads them: with ``latent_dim`` the latent
    ``[..., 2D]`` and its first ``latent_dim`` elements; else ``key`` and ``value``."""
    if latent_dim is None:
        return key, value
    latent = torch.cat((key, value), dim=-1)
    return latent, latent[..., :latent_dim]


def causal_mask(
    query_len: int,
    seq_len: int,
    sliding_window: int | None,
    device: torch.device,
    key_ends: torch.Tensor | None = None,  # [query_len] int: the segment's key ends
) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query j may attend key k: ``k <= position``,
    or with ``key_ends`` ``k < key_ends[j]`` (see the module docstring), and within the
    window if any."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    if key_ends is None:
        mask = k_pos <= q_pos
    else:
        mask = k_pos < key_ends.to(device)[:, None]
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _attend(
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, Dv]
    mask: torch.Tensor,  # bool, or additive float, [B or 1, 1, Lq, Lk]
    scale: float,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [B, Hq, Lq, Dv]
    """SDPA with grouped-query attention done by folding each KV head's query heads into
    the query length, so K and V are never copied per query head.

    ``sinks`` (GPT-OSS): one logit per query head that joins every row's softmax without a
    value, so a row may give less than all its weight to the keys. Done as one more key, of
    zeros with a zero value, whose score the mask sets to the head's sink."""
    batch, num_q_heads, query_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_q_heads // num_kv_heads
    if sinks is not None:
        key, value, mask = _with_sink_key(key, value, mask, sinks, group, query.dtype)
    if group > 1:
        # Query head h reads KV head h // group (transformers' repeat_kv convention).
        query = query.reshape(batch, num_kv_heads, group * query_len, head_dim)
        if mask.shape[1] == 1:  # one mask for every head
            mask = mask.unsqueeze(2).expand(mask.shape[0], 1, group, *mask.shape[2:])
        # [B or 1, 1 or Hkv, group * Lq, Lk]
        mask = mask.reshape(mask.shape[0], -1, group * query_len, mask.shape[-1])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, query_len, value.shape[-1])


def _with_sink_key(
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, D]
    mask: torch.Tensor,  # bool, or additive float, [B or 1, 1, Lq, Lk]
    sinks: torch.Tensor,  # [Hq]
    group: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V with a zero key appended, and a per-query-head additive mask
    ``[B or 1, Hq, Lq, Lk + 1]`` whose last column is each head's sink (the zero key scores
    0, and ``scale`` does not touch the mask)."""
    zeros = key.new_zeros(*key.shape[:2], 1, key.shape[3])
    key, value = torch.cat((key, zeros), dim=2), torch.cat((value, zeros), dim=2)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf")
        )
    num_kv_heads = key.shape[1]
    lead, _, query_len, _ = mask.shape
    # [lead, Hkv, group, Lq, 1]: query head kv * group + g's sink
    sink_column = sinks.to(dtype).view(1, num_kv_heads, group, 1, 1)
    sink_column = sink_column.expand(lead, num_kv_heads, group, query_len, 1)
    mask = mask[:, :, None].expand(lead, num_kv_heads, group, query_len, mask.shape[-1])
    mask = torch.cat((mask, sink_column), dim=-1)
    return key, value, mask.reshape(lead, num_kv_heads * group, query_len, mask.shape[-1])


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads]: see _attend
    latent_dim: int | None = None,  # see the module docstring
    *,
    key_ends: torch.Tensor | None = None,  # [num_tokens] int: see the module docstring
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim or latent_dim]
    """Attention of every query segment over its paged context, one segment at a time.

    ``key_ends`` (None: causal) lets a row see past itself, up to its key end; the caller
    guarantees ``position + 1 <= key_end <= seq_len`` for every row (not checked, which
    would cost a sync: a row left with no visible key gives NaN)."""
    if key_ends is not None and key_ends.shape != query.shape[:1]:
        raise ValueError(
            f"key_ends {tuple(key_ends.shape)} must hold one end per query row ({query.shape[0]})"
        )
    out = query.new_zeros(*query.shape[:2], latent_dim or query.shape[-1])
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
        key, value = latent_kv(key, value, latent_dim)
        seg_key_ends = None if key_ends is None else key_ends[q_start:q_end]
        mask = causal_mask(query_len, seq_len, sliding_window, query.device, seg_key_ends)
        seg = _attend(
            query[q_start:q_end].transpose(0, 1)[None],  # [1, Hq, Lq, D]
            key.transpose(0, 1)[None].to(query.dtype),  # [1, Hkv, Lk, D]
            value.transpose(0, 1)[None].to(query.dtype),
            mask[None, None],
            scale,
            sinks,
        )
        out[q_start:q_end] = seg[0].transpose(0, 1)
    return out


def expanded_latent_attention(
    query: torch.Tensor,  # [query_len, num_q_heads, qk_dim]: the heads' own queries
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, 1, latent_dim / 2]
    block_ids: torch.Tensor,  # [blocks of the segment] int64
    seq_len: int,
    scale: float,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:  # [query_len, num_q_heads, v_dim]
    """One segment of latent attention in the expanded form: its context's latents
    ``[seq_len, latent_dim]`` (the K and V slots joined) become per-head keys
    ``[seq_len, H, qk_dim]`` and values ``[seq_len, H, v_dim]`` by ``expand``, then causal
    multi-head attention of the segment's queries (the last ``query_len`` positions)."""
    key, value = gather_kv(kv_cache, block_ids, seq_len)
    key, value = expand(torch.cat((key, value), dim=-1)[:, 0].to(query.dtype))
    mask = causal_mask(query.shape[0], seq_len, None, query.device)[None, None]
    out = _attend(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                  value.transpose(0, 1)[None], mask, scale)  # fmt: skip
    return out[0].transpose(0, 1)


def decode_mask(
    seq_lens: torch.Tensor,  # [num_seqs]
    num_key_slots: int,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, 1, 1, num_key_slots] bool
    """Which of the padded key slots each single-token query attends to: the one-query
    case of ``short_query_mask``."""
    query_lens = torch.ones_like(seq_lens)
    return short_query_mask(seq_lens, query_lens, 1, num_key_slots, sliding_window)


class GatherWorkspace:
    """Output buffers the padded K/V gathers reuse, per cache shape (one K and one V each,
    grown as needed, at most a layer's pool of blocks: a padded gather past that is
    allocated fresh and not kept). A fresh multi-MB tensor every layer and step costs its
    page faults: reusing the buffers made a 134-268 MB gather 3.5-4x faster on this CPU
    (``benchmarks/torch_decode_attention.py``). What a gather returns is valid until the
    next gather of that shape; the caller is one thread (the engine's)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def take(
        self, kv_cache: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # two [num_blocks, block_size, H, D]
        if num_blocks > kv_cache.shape[0]:
            return None
        key = (tuple(kv_cache.shape[2:]), kv_cache.dtype, kv_cache.device)
        held = self._buffers.get(key)
        if held is None or held[0].shape[0] < num_blocks:
            held_blocks = 0 if held is None else held[0].shape[0]
            size = min(max(num_blocks, 2 * held_blocks), kv_cache.shape[0])  # doubling
            self._buffers.pop(key, None)  # freed before the larger pair is made
            shape = (size, *kv_cache.shape[2:])
            held = self._buffers[key] = (kv_cache.new_empty(shape), kv_cache.new_empty(shape))
        return held[0][:num_blocks], held[1][:num_blocks]


def _padded_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    workspace: GatherWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # two [num_seqs, num_kv_heads, key slots, head_dim]
    """Every sequence's keys and values, padded to the longest context's blocks.

    ``gather_kv`` of the flattened table: one ``index_select`` of the K (V) view, a copy
    of whole ``[block_size, Hkv, D]`` blocks into a contiguous ``[B * nb * bs, Hkv, D]``
    whose reshape to the sequences is free (into ``workspace``'s buffers when given). Indexing
    the view by the 2-D table instead (``kv[:, 0][table]``) gave the same tensor up to 2x
    slower on this CPU at the demo model's small blocks; the transposed result is what SDPA
    reads, strides and all, as fast as a contiguous copy."""
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_ids = block_table[:, :max_blocks].reshape(-1).long()
    buffers = None if workspace is None else workspace.take(kv_cache, block_ids.shape[0])
    key, value = gather_kv(kv_cache, block_ids, block_ids.shape[0] * block_size, buffers)
    # [B * nb * bs, Hkv, D] → [B, nb * bs, Hkv, D] → [B, Hkv, nb * bs, D]
    key = key.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    value = value.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return key, value


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    scale: float,
    sliding_window: int | None = None,
    attn_mask: torch.Tensor | None = None,  # decode_mask(...), or its additive float form
    sinks: torch.Tensor | None = None,  # [num_q_heads]: see _attend
    latent_dim: int | None = None,  # see the module docstring
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim or latent_dim]
    """Single-token queries for many sequences in one batched call (padded to the longest).

    ``attn_mask`` lets a caller build the mask once per step instead of once per layer; it
    must cover ``ceil(max(seq_lens) / block_size) * block_size`` key slots. ``workspace``:
    where the K/V gather goes (``GatherWorkspace``), else fresh tensors."""
    if query.shape[0] == 0:
        return query.new_empty(*query.shape[:2], latent_dim or query.shape[-1])
    padded = _padded_kv(kv_cache, seq_lens, block_table, workspace)
    key, value = _readable(*latent_kv(*padded, latent_dim), kv_cache, seq_lens, query.dtype)
    if attn_mask is None:
        attn_mask = decode_mask(seq_lens.to(query.device), key.shape[2], sliding_window)
    out = _attend(query[:, :, None, :], key, value, attn_mask, scale, sinks)  # [B, Hq, 1, D]
    return out[:, :, 0, :]


def _readable(
    key: torch.Tensor,  # [B, Hkv, key slots, D]: padded (``_padded_kv``), a copy
    value: torch.Tensor,  # [B, Hkv, key slots, Dv]
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` in ``dtype``, the slots past each sequence's length zeroed
    when the cache is not float32. Those slots (its last block's tail, the padding
    blocks of a shorter sequence) hold whatever the pool's blocks held, and only the mask
    keeps them out, which it cannot do for a NaN (NaN + -inf is NaN, and so is 0 x NaN)
    or for a key whose score overflows. A hybrid model's state snapshots are float32
    bytes in KV blocks: read back as FP8 or 16-bit values after the block was reused,
    they held NaNs, and a Qwen3.5 on an FP8 cache answered token 0 with NaN log-probs.
    A float32 cache reads those bytes as the finite values they were."""
    key, value = key.to(dtype), value.to(dtype)
    if kv_cache.dtype != torch.float32:
        slots = torch.arange(key.shape[2], device=key.device)
        past_end = (slots[None, :] >= seq_lens.to(key.device)[:, None])[:, None, :, None]
        key.masked_fill_(past_end, 0)
        value.masked_fill_(past_end, 0)
    return key, value


def short_query_mask(
    seq_lens: torch.Tensor,  # [num_seqs]
    query_lens: torch.Tensor,  # [num_seqs], each in 1 .. max_query_len
    max_query_len: int,
    num_key_slots: int,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, 1, max_query_len, num_key_slots] bool
    """Which key slots each query of a padded short segment attends to. A padding query
    (past its segment's length) gets its segment's last row, so no row is all masked."""
    j = torch.arange(max_query_len, device=seq_lens.device)[None, :]
    query_lens = query_lens.long()[:, None]
    q_pos = seq_lens.long()[:, None] - query_lens + torch.minimum(j, query_lens - 1)
    k_pos = torch.arange(num_key_slots, device=seq_lens.device)[None, None, :]
    mask = k_pos <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, :, None] - sliding_window
    return mask[:, None]


def short_query_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], segments back to back
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    padded_rows: torch.Tensor,  # [num_tokens] int64: segment i's query j -> i * max_len + j
    seq_lens: torch.Tensor,  # [num_seqs]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    scale: float,
    attn_mask: torch.Tensor,  # short_query_mask(...), or its additive float form
    sinks: torch.Tensor | None = None,  # [num_q_heads]: see _attend
    latent_dim: int | None = None,  # see the module docstring
    workspace: GatherWorkspace | None = None,  # as decode_attention's
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim or latent_dim]
    """Many short query segments (a decode and the drafts it verifies) in one batched
    call, each padded to the longest segment and the longest context: one SDPA call
    instead of one per segment, which costs a Python round trip per sequence and layer.
    ``attn_mask`` must cover ``ceil(max(seq_lens) / block_size) * block_size`` key slots."""
    num_seqs = seq_lens.shape[0]
    max_query_len = attn_mask.shape[2]
    num_q_heads, head_dim = query.shape[1:]
    padded_kv = _padded_kv(kv_cache, seq_lens, block_table, workspace)
    key, value = _readable(*latent_kv(*padded_kv, latent_dim), kv_cache, seq_lens, query.dtype)
    padded = query.new_zeros(num_seqs * max_query_len, num_q_heads, head_dim)
    padded[padded_rows] = query
    padded = padded.view(num_seqs, max_query_len, num_q_heads, head_dim).transpose(1, 2)
    out = _attend(padded, key, value, attn_mask, scale, sinks)
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, num_q_heads, value.shape[-1])
    return out[padded_rows]


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
    staging = as_movable(staging.to(kv_cache.dtype))
    as_movable(kv_cache).index_copy_(0, block_ids.to(kv_cache.device), staging)


def as_movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as copies take it: its bytes (a uint8 view) for the FP8 dtypes, which
    torch cannot ``index_copy_`` on a CPU."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def swiglu(
    gate: torch.Tensor,  # [rows, I]
    up: torch.Tensor,  # [rows, I]
    limit: float | None = None,
    alpha: float = 1.0,
) -> torch.Tensor:  # [rows, I]
    """SiLU(gate) * up; with ``limit`` GPT-OSS's clamped variant
    ``(clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    if limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts(
    hidden: torch.Tensor,  # [num_tokens, H]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    down_proj: torch.Tensor,  # [E, H, I]
    expert_ids: torch.Tensor,  # [num_tokens, k] int64, distinct per row (E: skipped)
    weights: torch.Tensor,  # [num_tokens, k]
    *,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.0,
    other_experts: bool = False,
    activation: str = "swiglu",
) -> torch.Tensor:  # [num_tokens, H]
    """sum_i weights[t, i] * down(SiLU(gate(x_t)) * up(x_t)) over token t's k experts;
    with ``activation`` "relu2" (Nemotron-H's ungated experts: ``gate_up_proj`` is then
    [E, I, H] of up rows alone) down(relu(up(x_t)) ** 2).
    An id of E (an expert another rank holds, under expert parallelism) adds nothing, with
    ``other_experts`` or without (the fused kernel's flag: here the output starts zeroed).

    Tokens are grouped by expert: each expert runs one gate/up and one down matmul over
    exactly its rows. The per-expert counts are read on the host (one sync).
    GPT-OSS: biases on both projections, and with ``swiglu_limit`` the clamped ``swiglu``.
    """
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)  # [num_tokens * k]: one slot per (token, choice)
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    num_experts = gate_up_proj.shape[0]
    # Slots of id E sort last, past the experts' runs: left out.
    counts = torch.bincount(flat_ids, minlength=num_experts)[:num_experts].tolist()
    token_of_slot = order // top_k  # [num_tokens * k]
    weight_of_slot = weights.reshape(-1)[order].unsqueeze(-1)  # [num_tokens * k, 1]
    out = torch.zeros_like(hidden)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_slot[start : start + count]  # [count]
        gate_up_b = None if gate_up_bias is None else gate_up_bias[expert]
        projected = F.linear(hidden[tokens], gate_up_proj[expert], gate_up_b)
        if activation == "relu2":
            act = F.relu(projected).square()
        else:
            gate, up = projected.chunk(2, dim=-1)
            act = swiglu(gate, up, swiglu_limit, swiglu_alpha)
        down_b = None if down_bias is None else down_bias[expert]
        expert_out = F.linear(act, down_proj[expert], down_b)  # [count, H]
        expert_out = expert_out * weight_of_slot[start : start + count]
        # Each token meets each expert at most once, and experts are added in index
        # order: the sum per token is transformers' own, bit for bit on the same rows.
        out.index_add_(0, tokens, expert_out.to(out.dtype))
        start += count
    return out
