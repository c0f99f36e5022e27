"""Drafts from the checkpoint's MTP layer, proposed right after each step
(``engine.speculative_method: mtp``; the layer itself is ``engine/models/mtp.py``).

After the target's forward pass and sampling, every position whose next token is now
known gets one MTP pass, all requests in one batch:

* a prompt chunk that is not the last: each of its positions, with the prompt token after
  it (``SequenceChunk.next_token_id`` is the one after the chunk);
* a sampling chunk: its own positions and the drafts it kept, with the tokens after them,
  ending with the token the step sampled last.

This writes the MTP layer's KV for exactly the positions the target computed and kept (a
rejected draft's MTP KV is overwritten by the next step's pass, as the target's is), and
the pass's last row for each request gives its first draft, ``t_{L+2}`` for its last kept
position ``L``. Each further draft is one more single-token pass, fed the layer's own
previous state and draft, at position ``L + j`` (the next step rewrites these positions'
MTP KV from the target's real states). The scheduler allocates those slots ahead
(``Scheduler._lookahead``) when the pool has room; without them the drafts stop where the
request's blocks end. Drafts are greedy: a draft only ever costs or saves a step, since
the sampler keeps one only if it is the token the request samples there.

A prefill worker runs the pass too: the prompt's MTP KV then travels with its blocks, so
the decode worker's drafts attend to the whole prompt, and its drafts after the first token
go with that token (``RequestOutput.draft_token_ids``) for the decode worker's first step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.config_base import ConfigError
from common.engine_config import EngineConfig, SpeculativeMethod
from engine.model_shard import HostBatch
from engine.models.arch import ModelArchConfig

if TYPE_CHECKING:
    from engine.model_runner import SequenceChunk


@dataclass(slots=True)
class MtpSegment:
    """One request's positions in an MTP pass (the fields ``HostBatch`` is built from)."""

    request_id: str
    token_ids: list[int]  # the token after each position (a draft model's: at each)
    start_pos: int
    block_ids: list[int]
    rows: range  # rows of the hidden states before the first pass's positions
    num_drafts: int  # drafts wanted after this step (0: write the MTP KV only)


def check_mtp(config: EngineConfig, arch: ModelArchConfig, model_dir: object) -> None:
    """Raise ``ConfigError`` if this engine cannot draft with an MTP layer as configured."""
    if config.speculative_method is not SpeculativeMethod.MTP:
        return
    if arch.num_mtp_layers == 0:
        raise ConfigError(
            "engine.speculative_method",
            f"mtp needs a multi-token-prediction layer; {model_dir} ({arch.architecture}) "
            "has none (DeepSeek-V3's and GLM-4.5's checkpoints do: num_nextn_predict_layers)",
        )


def mtp_segment(
    chunk: SequenceChunk, sampled: list[int] | None, first_row: int
) -> MtpSegment | None:
    """The MTP pass's part of ``chunk`` (its rows from ``first_row``), which sampled
    ``sampled`` (the drafts it kept, then the new token; None: it sampled nothing). None
    for a chunk that takes no part (a pooled one)."""
    if sampled is not None:
        assert chunk.sampling is not None
        num_own = len(chunk.token_ids) - (chunk.sampling.num_positions - 1)
        following = chunk.token_ids[1:num_own] + sampled
    elif chunk.next_token_id is not None:
        following = chunk.token_ids[1:] + [chunk.next_token_id]
    else:
        return None
    return MtpSegment(
        chunk.request_id, following, chunk.start_pos, chunk.block_ids,
        range(first_row, first_row + len(following)),
        chunk.num_drafts if sampled is not None else 0,
    )  # fmt: skip


def slots_end(block_ids: list[int], block_size: int, max_model_len: int) -> int:
    """The first position a request has no slot for: where its blocks end, or
    ``max_model_len``. A drafting pass writes nothing at or past it."""
    return min(len(block_ids) * block_size, max_model_len)


# One MTP pass on every rank: (batch, hidden_rows, from_target, logit_rows) -> the logits
# of logit_rows, or None without any (``ModelShard.mtp_pass``).
MtpPassRunner = Callable[[HostBatch, list[int], bool, list[int]], torch.Tensor | None]


def propose_drafts(
    run_pass: MtpPassRunner,
    host_batch: Callable[[list[MtpSegment]], HostBatch],
    segments: list[MtpSegment],
    block_size: int,
    max_model_len: int,
) -> dict[str, list[int]]:
    """Run the MTP passes of one step (after its target pass); returns each drafting
    request's drafts."""
    segments = sorted(segments, key=lambda s: len(s.token_ids))  # decodes lead (BatchLayout)
    batch = host_batch(segments)
    rows = [row for segment in segments for row in segment.rows]
    drafting = [(i, s) for i, s in enumerate(segments) if s.num_drafts > 0]
    last_rows = [batch.query_start_loc[i + 1] - 1 for i, _ in drafting]
    logits = run_pass(batch, rows, True, last_rows)  # [num drafting, vocab]
    if logits is None:
        return {}
    tokens = logits.argmax(dim=-1).tolist()
    drafts = {s.request_id: [token] for (_, s), token in zip(drafting, tokens, strict=True)}
    live = [s for _, s in drafting]  # in the rows of the last pass's drafting states
    for j in range(1, max(s.num_drafts for s in live)):
        # Draft j + 1: the layer at position L + j, fed draft j and its own state at L + j - 1.
        keep = [
            k
            for k, s in enumerate(live)
            if s.num_drafts > j
            and _last_pos(s) + j < slots_end(s.block_ids, block_size, max_model_len)
        ]
        if not keep:
            break
        live = [live[k] for k in keep]
        step = [
            MtpSegment(
                s.request_id, [drafts[s.request_id][-1]], _last_pos(s) + j, s.block_ids,
                range(0), s.num_drafts,
            )
            for s in live
        ]  # fmt: skip
        logits = run_pass(host_batch(step), keep, False, list(range(len(keep))))
        assert logits is not None
        for segment, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
            drafts[segment.request_id].append(token)
    return drafts


def _last_pos(segment: MtpSegment) -> int:
    """The position of the segment's last row in the first pass (its last kept one)."""
    return segment.start_pos + len(segment.token_ids) - 1
