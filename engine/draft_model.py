"""Drafts from a separate, smaller model (``engine.speculative_method: draft_model``).

The draft is a ``ModelShard`` of its own on rank 0's device: never split (a 1B draft
gains nothing from tensor parallelism, and rank 0 alone reads its drafts), with a KV
cache of its own shape (its layers, heads and head size) indexed by the target's block
ids, so one block table and one slot mapping serve both models, and a block's memory is
both models' bytes. Its token ids must be the target's (the same tokenizer); its
vocabulary may be the smaller one (Qwen2.5's small models pad fewer rows): a target token
beyond it reads as token 0.

Its passes follow the MTP layer's (``mtp_drafts.propose_drafts``), one position later:
after each step, the draft reads each token that became known, at its own position (the
prompt token after a chunk, the drafts the step kept and the token it sampled), which
writes its KV one position ahead of the target's; the last row's logits give the first
draft, and each further draft is one single-token pass. So after any step in which a
request took part, the draft holds KV for positions ``0 .. num_computed_tokens``, or up
to where the request's slots end when the step's last token has none yet (a prompt that
fills its blocks): ``Request.draft_kv_end`` says which. A chunk leads with the tokens the
draft has not read (``SequenceChunk.draft_lead``): a request's first chunk its own first
token, and on a decode worker the whole prompt, whose target KV came from the prefill
worker but whose draft KV did not; the chunk after a cut step, the token it cut. A
step's leads read at most ``max_num_batched_tokens`` tokens beyond one per request: a
longer one catches up over several steps, proposing nothing until it has.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.config_base import ConfigError
from common.engine_config import EngineConfig, SpeculativeMethod
from common.hf_config import draft_vocab_problem
from engine.model_shard import HostBatch, ModelShard
from engine.models.arch import ModelArchConfig, ModelLoadError, read_arch_config
from engine.mtp_drafts import MtpSegment, mtp_segment

if TYPE_CHECKING:
    from engine.model_runner import SequenceChunk


class DraftModel:
    def __init__(
        self,
        target: ModelArchConfig,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        """Load ``config.draft_model``. Raises ``ConfigError`` if it cannot draft for
        ``target`` (no checkpoint there, token ids beyond the target's vocabulary)."""
        assert config.draft_model is not None
        model_dir = Path(config.draft_model)
        try:
            arch = read_arch_config(model_dir)
        except ModelLoadError as exc:
            raise ConfigError("engine.draft_model", str(exc)) from None
        problem = draft_vocab_problem(model_dir, arch.vocab_size, target.vocab_size)
        if problem is None and arch.linear_attention is not None:
            problem = (f"{model_dir} has linear-attention layers: a draft model keeps KV "
                       "only (its states would need slots of their own)")  # fmt: skip
        if problem is not None:
            raise ConfigError("engine.draft_model", problem)
        alone = config.replace(
            speculative_method=SpeculativeMethod.NGRAM, num_speculative_tokens=0,
            draft_model=None, tensor_parallel_size=1, expert_parallel=False,
            num_redundant_experts=0, expert_rebalance_interval=0,
        )  # fmt: skip
        self.vocab_size = arch.vocab_size
        # Only a draft of fewer ids can be fed one it does not know (``run_pass``).
        self.fewer_ids = arch.vocab_size < target.vocab_size
        self.shard = ModelShard(model_dir, arch, alone, device, dtype, max_model_len)

    @property
    def bytes_per_block(self) -> int:
        return self.shard.bytes_per_block

    def allocate(self, num_blocks: int) -> None:
        """Its KV cache, of the target's block count (the same block ids)."""
        self.shard.allocate(num_blocks)

    def run_pass(
        self, batch: HostBatch, hidden_rows: list[int], from_target: bool, logit_rows: list[int]
    ) -> torch.Tensor | None:
        """``mtp_drafts.MtpPassRunner`` for the draft: a forward pass over ``batch``
        (writing its KV), the logits of ``logit_rows`` ([len, draft vocab] float32); None
        without any. It reads no hidden states: ``hidden_rows`` and ``from_target`` are
        the MTP layer's. A target token beyond the draft's vocabulary (a padding row
        the target sampled) reads as token 0: the draft cannot know it, and a wrong
        guess there costs only a draft."""
        vocab = self.vocab_size
        if self.fewer_ids and any(token >= vocab for token in batch.input_ids):
            known = [token if token < vocab else 0 for token in batch.input_ids]
            batch = dataclasses.replace(batch, input_ids=known)
        hidden = self.shard.forward(batch, None)  # [num_tokens, draft hidden]
        if not logit_rows:
            return None
        rows = self.shard.to_device(logit_rows, torch.int64)
        return self.shard.model.compute_logits(hidden[rows])


def draft_segment(
    chunk: SequenceChunk, sampled: list[int] | None, first_row: int, capacity: int
) -> MtpSegment | None:
    """The draft's part of ``chunk`` after a step that sampled ``sampled`` (as
    ``mtp_segment``): the tokens that became known, each at its own position, led by
    ``chunk.draft_lead`` (only the lead while it catches up); cut where the request's
    slots end (``capacity``: its blocks' positions, or ``max_model_len``), and then it
    proposes nothing. None: no part. The draft reads up to ``start_pos +
    len(token_ids)`` (``Request.draft_kv_end``): a cut segment short of the step's
    last token (a prompt that fills its last block: no slot yet for the token it
    sampled), empty when it reads nothing, and the next step leads with the rest."""
    lead = chunk.draft_lead
    if chunk.draft_catching_up:  # a part of what it has not read, no drafts yet
        return MtpSegment(chunk.request_id, lead, chunk.draft_lead_pos, chunk.block_ids,
                          range(0), 0)  # fmt: skip
    segment = mtp_segment(chunk, sampled, first_row)
    if segment is None:
        return None
    segment.token_ids = lead + segment.token_ids
    segment.start_pos = chunk.draft_lead_pos if lead else chunk.start_pos + 1
    room = capacity - segment.start_pos
    if len(segment.token_ids) > room:  # the last kept token has no slot yet
        segment.token_ids = segment.token_ids[:room]
        segment.num_drafts = 0
    return segment
