"""Paged attention in Triton: the fast twins of ``reference.paged_attention`` and
``reference.decode_attention`` (same layout, same arguments, same results within rounding).

One batch is served by up to three launches: the leading ``num_decodes`` single-token
segments in a decode launch (split-KV when the batch is too small to fill the GPU, followed by
a merge), and the remaining segments (prompt chunks of any length, attending to their cached
prefix and causally to themselves) in one prefill launch. See ``paged_attention_kernel.py``.

Optional *key ends* (see ``reference``) let a prompt row see later keys, up to its key end
(Gemma 3's image tokens see their whole image); only the prefill launch reads them.
"""

from __future__ import annotations

import torch

from kernels.attention_config import (
    LaunchConfig,
    decode_config,
    device_num_sms,
    device_smem_bytes,
    num_kv_splits,
    prefill_config,
)
from kernels.paged_attention_kernel import merge_splits_kernel, paged_attention_kernel
from kernels.triton_utils import dot_dtype, dot_precision, next_pow2, require_runnable

LOG2_E = 1.4426950408889634


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"expected query [T, Hq, D] and kv_cache [blocks, 2, block_size, Hkv, D], got "
            f"{tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query heads/dim {tuple(query.shape[1:])} do not fit {num_kv_heads} KV heads "
            f"of dim {head_dim}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    if not kv_cache.dtype.is_floating_point:  # an int8 cache would be read as plain ints
        raise TypeError(f"kv_cache must be a float or fp8 tensor, got {kv_cache.dtype}")


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    sinks: torch.Tensor | None = None,
    num_decodes: int = 0,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    decode: LaunchConfig | None = None,
    prefill: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,  # [num_tokens] int32, on the query's device
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of every query segment over its paged context.

    ``num_decodes``: the caller promises that the first that many segments are query rows
    ``0 .. num_decodes - 1``, one each; they take the (split-KV) decode launch.
    ``max_seq_len`` (an upper bound of their ``seq_lens``) sizes the splits; None reads it
    from the device (a sync). ``num_splits`` (a power of two), ``decode`` and ``prefill``
    override the tuned choices. Rows outside every segment are left unwritten in ``out``.
    Segments whose ``seq_len`` is 0 give zeros, like the reference. ``sinks``
    ([num_q_heads]): a logit per query head in every row's softmax, with no value (GPT-OSS).
    ``key_ends``: each row sees the keys below its key end instead of those up to itself;
    the caller guarantees ``position + 1 <= key_end <= seq_len`` (not checked: a sync).
    Decode rows are read as causal (their key end can only be ``seq_len``).
    """
    launch = _Launch(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window, out,
        sinks, key_ends,
    )  # fmt: skip
    num_seqs = seq_lens.shape[0]
    if not 0 <= num_decodes <= min(num_seqs, query.shape[0]):
        raise ValueError(f"num_decodes={num_decodes} out of range for {num_seqs} segments")
    if num_decodes:
        launch.decodes(num_decodes, max_seq_len, num_splits, decode)
    if num_decodes < num_seqs and query.shape[0] > num_decodes:
        config = prefill or prefill_config(
            query.shape[2],
            query.dtype,
            launch.group,
            query.shape[0] - num_decodes,
            device_smem_bytes(query.device),
        )
        num_rows = query.shape[0] - num_decodes
        launch.run(num_decodes, num_seqs - num_decodes, num_rows, config, decode_only=False)
    return launch.out


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    sinks: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Single-token queries for many sequences: ``paged_attention`` with every segment a
    decode (and no ``query_start_loc`` to build)."""
    launch = _Launch(
        query, kv_cache, None, seq_lens, block_table, scale, sliding_window, None, sinks
    )
    if query.shape[0]:
        launch.decodes(query.shape[0], max_seq_len, num_splits, config)
    return launch.out


def _check_key_ends(key_ends: torch.Tensor | None, query: torch.Tensor) -> None:
    """Shape, dtype and device only: the values would take a sync to read."""
    if key_ends is None:
        return
    if (
        key_ends.shape != query.shape[:1]
        or key_ends.dtype != torch.int32
        or key_ends.device != query.device
    ):
        raise ValueError(
            f"key_ends ({tuple(key_ends.shape)} {key_ends.dtype} on {key_ends.device}) must "
            f"be int32, one per query row ({query.shape[0]}), on the query's device "
            f"({query.device})"
        )


class _Launch:
    """What the decode and prefill launches of one call share."""

    def __init__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor | None,  # None: decode launches only
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
        key_ends: torch.Tensor | None = None,  # [num_tokens] int32: prefill launch only
    ) -> None:
        _check_inputs(query, kv_cache)
        _check_key_ends(key_ends, query)
        if sinks is not None and (sinks.shape != (query.shape[1],) or sinks.device != query.device):
            raise ValueError(
                f"sinks {tuple(sinks.shape)} on {sinks.device} must be one per query head "
                f"({query.shape[1]}) on the query's device"
            )
        require_runnable(paged_attention_kernel, query, kv_cache, seq_lens, block_table)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if query.stride(-1) != 1:
            query = query.contiguous()
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        elif out.shape != query.shape or out.device != query.device or out.stride(-1) != 1:
            raise ValueError(
                f"out {tuple(out.shape)} on {out.device} (stride {out.stride()}) must have "
                f"the query's shape {tuple(query.shape)}, be on its device and be "
                "contiguous in head_dim"
            )
        elif out.dtype != query.dtype:  # the store would round into it silently
            raise TypeError(f"out must have the query's dtype {query.dtype}, got {out.dtype}")
        # The kernels index these with element stride 1 (a no-op for the engine's tensors).
        seq_lens = seq_lens.contiguous()
        if query_start_loc is not None:
            query_start_loc = query_start_loc.contiguous()
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        self.query, self.kv_cache, self.out = query, kv_cache, out
        self.query_start_loc, self.seq_lens, self.block_table = (
            query_start_loc,
            seq_lens,
            block_table,
        )
        self.group = query.shape[1] // kv_cache.shape[3]
        self.qk_scale = scale * LOG2_E
        self.sliding_window = sliding_window
        self.sinks = None if sinks is None else sinks.contiguous()
        self.key_ends = None if key_ends is None else key_ends.contiguous()

    def decodes(
        self,
        num_decodes: int,
        max_seq_len: int | None,
        num_splits: int | None,
        config: LaunchConfig | None,
    ) -> None:
        """Segments ``0 .. num_decodes - 1`` (query rows of the same index)."""
        query = self.query
        config = config or decode_config(query.shape[2], query.dtype, self.group)
        if num_splits is None:
            if max_seq_len is None:
                max_seq_len = int(self.seq_lens[:num_decodes].max())
            num_splits = num_kv_splits(
                num_decodes,
                self.kv_cache.shape[3],
                max_seq_len,
                config.tile_n,
                device_num_sms(query.device),
            )
        self.run(0, num_decodes, num_decodes, config, decode_only=True, num_splits=num_splits)

    def run(
        self,
        first_seq: int,
        num_seqs: int,
        num_rows: int,  # upper bound of the query rows these segments own
        config: LaunchConfig,
        decode_only: bool,
        num_splits: int = 1,
    ) -> None:
        """Segments ``first_seq .. first_seq + num_seqs - 1`` in one launch (plus the merge
        when split). Splitting is for decode launches, whose rows are 0 .. num_seqs - 1."""
        query, kv_cache, out = self.query, self.kv_cache, self.out
        num_q_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        group = self.group
        if config.block_m < group:
            raise ValueError(f"block_m={config.block_m} is below the GQA group size {group}")
        if num_splits < 1 or num_splits != next_pow2(num_splits):
            raise ValueError(f"num_splits must be a power of two, got {num_splits}")
        assert decode_only or num_splits == 1
        block_q = 1 if decode_only else config.block_m // group
        num_q_blocks = num_seqs if decode_only else num_rows // block_q + num_seqs
        # tl.dot needs K >= 16 on NVIDIA GPUs: small head sizes are padded (and masked).
        head_dim_pad = max(16, next_pow2(head_dim))
        if num_splits > 1:
            part_out = torch.empty(
                (num_rows, num_q_heads, num_splits, head_dim_pad),
                dtype=torch.float32,
                device=query.device,
            )
            part_lse = torch.empty(part_out.shape[:3], dtype=torch.float32, device=query.device)
        else:
            part_out = part_lse = out  # unused
        # Decode: (segment, KV head, split); prefill: one flat axis, KV heads fastest.
        grid = (num_q_blocks, num_kv_heads, num_splits)
        if not decode_only:
            grid = (num_q_blocks * num_kv_heads, 1, 1)
        use_key_ends = self.key_ends is not None and not decode_only
        paged_attention_kernel[grid](
            out,
            query,
            kv_cache,
            self.seq_lens if self.query_start_loc is None else self.query_start_loc,
            self.seq_lens,
            self.block_table,
            part_out,
            part_lse,
            query if self.sinks is None else self.sinks,  # unused without sinks
            self.key_ends if use_key_ends else self.seq_lens,  # unused without key ends
            self.qk_scale,
            self.sliding_window or 0,
            first_seq,
            num_seqs,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            self.block_table.stride(0),
            NUM_Q_HEADS=num_q_heads,
            NUM_QUERIES_PER_KV=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=kv_cache.shape[2],
            BLOCK_M=config.block_m,
            BLOCK_Q=block_q,
            TILE_N=config.tile_n,
            NUM_SPLITS=num_splits,
            DECODE_ONLY=decode_only,
            USE_WINDOW=self.sliding_window is not None,
            USE_SINKS=self.sinks is not None,
            USE_KEY_ENDS=use_key_ends,
            DOT_DTYPE=dot_dtype(paged_attention_kernel, query.dtype),
            DOT_PRECISION=dot_precision(query.dtype),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        if num_splits > 1:
            merge_splits_kernel[(num_rows, num_q_heads)](
                out,
                part_out,
                part_lse,
                out.stride(0),
                out.stride(1),
                NUM_Q_HEADS=num_q_heads,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                NUM_SPLITS=num_splits,
                num_warps=4,
            )
