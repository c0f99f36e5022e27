"""Turns one step's chunks into one forward pass, then logits and sampled tokens.

Per step the runner builds a single flattened batch (``input_ids``, ``positions``,
``slot_mapping``, block table, query start offsets, sequence lengths), runs the model
(``ModelShard``: the weights and the KV cache), computes logits only at the last token of
chunks that sample (and at their draft tokens, when they verify drafts; and at the prompt
tokens of chunks that score their prompt), and samples. With an MTP layer it then proposes
the next step's drafts (``engine/mtp_drafts.py``). An embedding request's last chunk
is pooled instead: its last hidden state is the result, or its logits at the tokens it
names (``engine/pooling.py``).

With tensor parallelism the runner is rank 0: the other ranks' processes
(``engine/parallel``) get each step's batch first and run it alongside; logits and
sampling are rank 0's alone.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.engine_config import EngineConfig, SpeculativeMethod
from common.intmath import cdiv
from engine.attention.backend import AttentionBackend
from engine.block_table import BlockTable
from engine.cuda_graphs import DecodeGraphs
from engine.draft_model import DraftModel, draft_segment
from engine.images import ChunkImages, EncoderCache, image_embeds, image_key_ends
from engine.linear_state import DraftGroups, StateSlots
from engine.model_shard import HostBatch, ModelShard
from engine.models.arch import ModelArchConfig, ModelLoadError
from engine.models.image_processor import ImageProcessing, read_image_processing
from engine.models.lora import LoraAdapter, LoraBatch, load_lora_adapter
from engine.models.vision import AnyVisionEncoder, load_vision_encoder
from engine.mtp_drafts import MtpSegment, check_mtp, mtp_segment, propose_drafts, slots_end
from engine.parallel.expert_placement import imbalance, rebalance
from engine.parallel.group import SingleRank, TPGroup
from engine.parallel.launch import ShardExtensionSpec
from engine.parallel.messages import MtpPass, PlaceExperts, Step
from engine.parallel.shard_client import ShardClient, launch_shards
from engine.parallel.shard_spec import engine_split
from engine.pooling import PoolingParams, pick_token_logits, pool_last_tokens
from engine.request import TokenLogprobs
from engine.sampler import SamplingRow, sample, score_passes, score_tokens

logger = logging.getLogger(__name__)

BLOCK_TABLE_SPARE_ROWS = 32  # block-table rows beyond max_num_seqs (engine/block_table.py)


@dataclass(slots=True)
class SequenceChunk:
    """The tokens one request computes this step."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]: the request's num_computed_tokens
    # Every block of the request, covering start_pos + len(token_ids): the KV cache
    # manager's own list (KVCacheManager.block_ids_view), read during the step only.
    block_ids: list[int]
    sampling: SamplingRow | None  # None: a prompt chunk that is not the last, or pooled
    scoring: PromptScoring | None = None
    lora: LoraAdapter | None = None  # the request's LoRA adapter; None: the base model
    # An embedding request's last chunk: its last token's hidden state is pooled.
    pooling: PoolingParams | None = None
    # With an MTP layer: the prompt token after a chunk that is not the last (its MTP pass
    # reads it), and the drafts to propose after a sampling chunk (0: none).
    next_token_id: int | None = None
    num_drafts: int = 0
    # With a draft model: tokens it has not read yet, from position draft_lead_pos, up to
    # and including token_ids[0] (``engine/draft_model.py``); empty once it has. While it
    # catches up over several steps (a long pulled prompt), they stop short of start_pos
    # and it reads only them.
    draft_lead: list[int] = field(default_factory=list)
    draft_lead_pos: int = 0
    draft_catching_up: bool = False
    # A vision-language model's images this chunk's positions overlap (``engine/images.py``).
    images: ChunkImages | None = None
    # [3, len(token_ids)] rotary positions where they are not the sequence's (M-RoPE).
    rope_positions: np.ndarray | None = None
    # A hybrid model's state snapshots (``ScheduledRequest``): the blocks its states
    # start from (a prefix-cache hit), and those they are copied into after the step.
    restore_block_ids: list[int] | None = None
    snapshot_block_ids: list[int] | None = None


@dataclass(slots=True)
class PromptScoring:
    """Log-probs of prompt tokens: chunk rows ``first_row ..`` predict ``target_token_ids``
    (the prompt tokens right after them), with the top ``num_top`` of each distribution."""

    first_row: int
    target_token_ids: list[int]
    num_top: int


@dataclass(slots=True)
class StepResult:
    """What one forward pass produced, by request id."""

    # The tokens each sampling chunk yields (more than one when drafts were kept).
    sampled: dict[str, list[tuple[int, TokenLogprobs | None]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Pooled chunks': [hidden_size] float32 CPU rows of one step's tensor, or
    # [len(pooling.token_ids)] logits for those that name tokens.
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
    # The MTP layer's drafts for each request's next step (``engine/mtp_drafts.py``).
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # With a draft model: the position up to which it has read each request's tokens
    # (``Request.draft_kv_end``; ``engine/draft_model.py``).
    draft_kv_end: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        arch: ModelArchConfig,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        lora_adapters: Mapping[str, Path] | None = None,
        extension: ShardExtensionSpec | None = None,
    ) -> None:
        """``lora_adapters``: name -> PEFT adapter directory, loaded now; more may be
        added and removed later (``LLMEngine.add_lora_adapter``). A chunk carries its
        request's adapter object (``SequenceChunk.lora``), not a name, so removing one
        from this table never pulls it from under a request that runs with it.

        With ``config.tensor_parallel_size`` > 1 this is rank 0 of the group: it starts
        the other ranks' processes (``shards``, with ``extension`` in each), holds its own
        ``ModelShard``, and every step sends the batch to the others before running it."""
        check_mtp(config, arch, model_dir)
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.tp = engine_split(config, 0)
        self.shards: ShardClient | None = None
        self.shard_payloads: list[bytes] = []  # each shard's extension payload (rank 1..)
        self._adapter_ids: weakref.WeakKeyDictionary[LoraAdapter, int] = weakref.WeakKeyDictionary()
        self.lora_adapters: dict[str, LoraAdapter] = {}
        group: TPGroup = SingleRank()
        try:
            if self.tp.size > 1:
                self.shards = launch_shards(
                    model_dir, arch, config, device, dtype, max_model_len, extension
                )
                self.shards.wait_hello()
                group = self.shards.join_group()
            self.shard = ModelShard(model_dir, arch, config, device, dtype, max_model_len, group)
            # A vision-language model's image encoder (rank 0's alone: it broadcasts the
            # rows), its recent output, and the images it encoded so far.
            self.vision: AnyVisionEncoder | None = None
            self.image_processing: ImageProcessing | None = None
            self.encoder_cache = EncoderCache(config.encoder_cache_bytes)
            self.num_images_encoded = 0
            if arch.vision is not None:
                self.vision = load_vision_encoder(model_dir, arch.vision, device, dtype)
                vision = arch.vision
                image_size = getattr(vision.tower, "image_size", 0)  # fixed-size towers'
                try:  # preprocessor_config.json
                    self.image_processing = read_image_processing(
                        model_dir, image_size, vision.grid
                    )
                except ValueError as exc:
                    raise ModelLoadError(str(exc)) from None
            self.draft: DraftModel | None = None
            if config.speculative_method is SpeculativeMethod.DRAFT_MODEL:
                self.draft = DraftModel(arch, config, device, dtype, max_model_len)
            # A block holds the draft's KV too, on rank 0.
            draft_bytes = self.draft.bytes_per_block if self.draft is not None else 0
            num_blocks = self.shard.max_num_blocks(draft_bytes)
            if self.shards is not None:
                num_blocks = min(num_blocks, self.shards.wait_loaded())
                self.shards.allocate(num_blocks)
            self.shard.allocate(num_blocks)
            if self.draft is not None:
                self.draft.allocate(num_blocks)
            if self.shards is not None:
                self.shard_payloads = self.shards.wait_started()
            for name, path in (lora_adapters or {}).items():
                adapter = self.read_lora_adapter(name, path)
                self.share_lora_adapter(adapter)
                self.lora_adapters[name] = adapter
        except BaseException:
            if self.shards is not None:
                self.shards.close()
            group.close()
            raise
        self.group = group
        # Expert parallelism's rebalancing (``engine.expert_rebalance_interval``; nothing
        # to place in a model without routed experts).
        self.expert_rebalance_interval = config.expert_rebalance_interval
        if not self.shard.moe_layers:
            self.expert_rebalance_interval = 0
        self._steps_since_rebalance = 0
        self.expert_balance = ExpertBalance()
        # A hybrid model's linear-attention state slots, one per request a step may hold.
        self.state_slots: StateSlots | None = None
        # ... the groups of draft slots that requests verifying drafts hold (the
        # scheduler takes them: ``DraftGroups``), and each request's last decode that
        # verified drafts: (its first position, tokens), until its next step shows how
        # many the sampler kept (``_accepted``; it holds its group until then).
        self.draft_groups: DraftGroups | None = None
        if arch.linear_attention is not None:
            self.state_slots = StateSlots(self.shard.num_request_slots)
            if self.shard.num_draft_groups:
                self.draft_groups = DraftGroups(self.shard.num_draft_groups)
        self._verified: dict[str, tuple[int, int]] = {}
        # Rows for every request a step may hold, and some for preempted ones waiting.
        self.block_table = BlockTable(
            config.max_num_seqs + BLOCK_TABLE_SPARE_ROWS,
            cdiv(max_model_len + config.num_speculative_tokens, config.block_size) + 1,
            pin_memory=device.type == "cuda",
        )

    # The rank-0 shard's parts, which the engine and connectors use.
    @property
    def model(self) -> torch.nn.Module:
        return self.shard.model

    @property
    def backend(self) -> AttentionBackend:
        return self.shard.backend

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.shard.kv_caches

    @property
    def draft_kv_caches(self) -> list[torch.Tensor]:
        """The draft model's KV caches (the target's block ids), or none."""
        return self.draft.shard.kv_caches if self.draft is not None else []

    @property
    def num_blocks(self) -> int:
        return self.shard.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.shard.bytes_per_block

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.shard.decode_graphs

    def release_request(self, request_id: str) -> None:
        """A request is done: drop its block-table row."""
        self.block_table.release(request_id)

    def release_state(self, request_id: str) -> None:
        """A request's blocks were freed: its linear-attention state slot goes with them
        (a no-op without such layers)."""
        if self.state_slots is not None:
            self.state_slots.release(request_id)
            self._verified.pop(request_id, None)
        if self.draft_groups is not None:
            self.draft_groups.release(request_id)

    def park_state(self, request_id: str, holder: str) -> None:
        """The request's state slot, which its late pull may still write, stays out of use
        under ``holder`` until ``release_state(holder)`` (a no-op without such layers)."""
        if self.state_slots is not None:
            self.state_slots.rename(request_id, holder)

    def reserve_state(self, request_id: str) -> list[int]:
        """A state slot for a request whose states are about to be pulled: the KV blocks
        to pull them into."""
        assert self.state_slots is not None and self.shard.state_pool is not None
        return self.shard.state_pool.block_ids(self.state_slots.reserve(request_id))

    def state_block_ids(self, request_id: str) -> list[int]:
        """The KV blocks holding a request's linear-attention states; empty without such
        layers (or a slot)."""
        if self.state_slots is None or self.shard.state_pool is None:
            return []
        slot = self.state_slots.slot(request_id)
        return [] if slot is None else self.shard.state_pool.block_ids(slot)

    def leak_report(self) -> list[str]:
        """Block-table rows still held, and what the other ranks hold beyond rank 0's
        live adapters."""
        problems = []
        if self.block_table.num_rows_used:
            problems.append(f"{self.block_table.num_rows_used} block-table rows still held")
        if self.state_slots is not None and self.state_slots.num_used:
            problems.append(f"{self.state_slots.num_used} linear-attention state slots held")
        if self._verified:
            problems.append(f"{len(self._verified)} requests' verified drafts still remembered")
        if self.draft_groups is not None and self.draft_groups.num_used:
            problems.append(f"{self.draft_groups.num_used} groups of draft state slots held")
        if self.shards is None:
            return problems
        live = len(self._adapter_ids)
        return problems + [
            f"tensor-parallel rank {reply.rank} holds {reply.num_adapters} LoRA adapters, "
            f"rank 0 {live}"
            for reply in self.shards.probe()
            if reply.num_adapters != live
        ]

    def close(self) -> None:
        """Stop the other ranks (tensor parallelism); a no-op alone. Idempotent."""
        if self.shards is not None:
            self.shards.close()
        self.group.close()

    def _host_batch(self, chunks: list[SequenceChunk] | list[MtpSegment]) -> HostBatch:
        bs = self.block_size
        batch = HostBatch()
        width = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            end = chunk.start_pos + n
            batch.input_ids.extend(chunk.token_ids)
            chunk_positions = range(chunk.start_pos, end)
            batch.positions.extend(chunk_positions)
            blocks = chunk.block_ids
            batch.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in chunk_positions)
            batch.query_start_loc.append(batch.query_start_loc[-1] + n)
            batch.seq_lens.append(end)
            width = max(width, cdiv(end, bs))
        batch.block_table = self.block_table.gather(
            [chunk.request_id for chunk in chunks], [chunk.block_ids for chunk in chunks], width
        )
        batch.rope_positions, batch.mrope_positions = rope_positions(batch.positions, chunks)
        return batch

    def _assign_state_slots(self, chunks: list[SequenceChunk], batch: HostBatch) -> None:
        """A hybrid model's: each chunk's state slot, which start from zero, which from a
        cached snapshot, and which are snapshotted after the step."""
        assert self.state_slots is not None
        batch.state_slots, batch.fresh_slots = [], []
        batch.state_restores, batch.state_snapshots = [], []
        batch.state_accepts, batch.state_drafts = [], []
        for seq, chunk in enumerate(chunks):
            restored = chunk.restore_block_ids is not None
            if restored:  # starts past its first token, from a snapshot: a new slot
                slot, fresh = self.state_slots.reserve(chunk.request_id), False
                batch.state_restores.append([slot, *chunk.restore_block_ids])
            else:
                slot, fresh = self.state_slots.assign(chunk.request_id, chunk.start_pos)
            batch.state_slots.append(slot)
            if fresh:
                batch.fresh_slots.append(slot)
            accepted = self._accepted(chunk)
            if accepted is not None:
                batch.state_accepts.append([accepted, slot])
            num_drafts = len(chunk.sampling.draft_token_ids) if chunk.sampling else 0
            source = slot  # of a snapshot after the step: the states after its tokens
            if num_drafts:  # keep its states after each token: the sampler may keep any
                assert self.draft_groups is not None
                group = self.draft_groups.slot(chunk.request_id)
                assert group is not None, f"{chunk.request_id} verifies drafts in no group"
                draft_slots = self.shard.draft_slots(group)[: len(chunk.token_ids) - 1]
                batch.state_drafts.append([seq, *draft_slots])
                self._verified[chunk.request_id] = (chunk.start_pos, len(chunk.token_ids))
                source = draft_slots[len(chunk.token_ids) - num_drafts - 1]  # not the drafts
            elif self.draft_groups is not None:
                # Its group's slots are read (accepted) before this step's forward pass,
                # and scheduling, which may give the group to another, comes after it.
                self.draft_groups.release(chunk.request_id)
            if chunk.snapshot_block_ids is not None:
                batch.state_snapshots.append([source, *chunk.snapshot_block_ids])

    def _accepted(self, chunk: SequenceChunk) -> int | None:
        """For a request whose last step verified drafts: the slot holding its states
        after the last token the sampler kept, which its own slot must take before this
        step (None when it kept them all: its slot has them). Its step starts right after
        that token."""
        verified = self._verified.pop(chunk.request_id, None)
        if verified is None:
            return None
        start, num_tokens = verified
        num_kept = chunk.start_pos - start
        assert 0 < num_kept <= num_tokens, (chunk.request_id, verified, chunk.start_pos)
        if num_kept == num_tokens:
            return None
        assert self.draft_groups is not None
        group = self.draft_groups.slot(chunk.request_id)  # (held since it verified)
        assert group is not None, f"{chunk.request_id} verified drafts in no group"
        return self.shard.draft_slots(group)[num_kept - 1]

    def _forward(
        self, chunks: list[SequenceChunk], batch: HostBatch, logit_rows: list[list[int]]
    ) -> torch.Tensor:
        """Hidden states of every token, on every rank (the others told first, with the
        rows of each logits pass they take part in)."""
        lora_rows = self._lora_rows(chunks, batch)
        with_images = [
            (batch.query_start_loc[i], c.start_pos, c.start_pos + len(c.token_ids), c.images)
            for i, c in enumerate(chunks)
            if c.images is not None
        ]
        images = None
        if with_images:  # encoded before the other ranks are told: they wait on no encoder
            assert self.vision is not None and self.image_processing is not None
            images, num_encoded = image_embeds(
                self.vision, self.image_processing, self.encoder_cache, with_images, self.device
            )
            self.num_images_encoded += num_encoded
            if self.vision.spec.bidirectional:
                batch.key_ends = image_key_ends(batch.positions, with_images)
        if self.shards is not None:
            self.shards.send(
                Step(
                    *_wire_batch(batch),
                    [(self._adapter_ids[a], rows) for a, rows in lora_rows.items()],
                    logit_rows,
                    images[0].tolist() if images is not None else [],
                    batch.key_ends or [],
                    batch.rope_positions or [],
                    [] if batch.mrope_positions is None else batch.mrope_positions.tolist(),
                    batch.state_slots or [],
                    batch.fresh_slots or [],
                    batch.state_restores or [],
                    batch.state_snapshots or [],
                    batch.state_accepts or [],
                    batch.state_drafts or [],
                )
            )  # fmt: skip
        lora = None
        if lora_rows:
            lora = LoraBatch(
                tuple(
                    (adapter, self.shard.to_device(rows, torch.int64))
                    for adapter, rows in lora_rows.items()
                )
            )
        return self.shard.forward(batch, lora, images)

    def _fail_shards(self, exc: BaseException) -> None:
        """Rank 0 left a step (or an MTP pass) between its message and its last
        collective: the other ranks are somewhere inside it, out of step for good."""
        if self.shards is not None:
            self.shards.find_exited(wait_s=0.5)  # a dead rank is the likely cause
            self.shards.fail(f"rank 0's step ended early ({type(exc).__name__}: {exc})")

    def read_lora_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Read a PEFT adapter for this model onto its device, cut for rank 0 (any thread:
        it touches nothing of the runner's); a bad one raises ``ModelLoadError``."""
        return load_lora_adapter(name, path, self.arch, self.device, self.dtype, self.tp)

    def share_lora_adapter(self, adapter: LoraAdapter) -> None:
        """Make the other ranks hold ``adapter`` too (a no-op alone), before any request
        uses it; they drop it once rank 0's object is gone (no request or table holds
        it). Raises ``ShardError`` if one cannot read its files or reads other files."""
        if self.shards is None or adapter in self._adapter_ids:
            return
        adapter_id = self.shards.add_lora(adapter.name, adapter.path, adapter.fingerprint)
        self._adapter_ids[adapter] = adapter_id
        weakref.finalize(adapter, self.shards.lora_dropper(), adapter_id)

    def _lora_rows(
        self, chunks: list[SequenceChunk], batch: HostBatch
    ) -> dict[LoraAdapter, list[int]]:
        """The rows of each adapter in this step; empty when no chunk uses one."""
        rows: dict[LoraAdapter, list[int]] = {}  # by identity (eq=False)
        for i, chunk in enumerate(chunks):
            if chunk.lora is not None:
                start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
                rows.setdefault(chunk.lora, []).extend(range(start, end))
        return rows

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> StepResult:
        """Run one step: the sampled token (and log-probs) of each sampling chunk, the
        prompt log-probs of each scoring one, and the embedding of each pooled one (or its
        logits at the tokens it names)."""
        result = StepResult()
        if not chunks:
            return result
        # Shortest first: decodes lead (backends batch single-token segments together),
        # then short segments (decodes with drafts; the torch backend batches those too).
        chunks = sorted(chunks, key=lambda c: len(c.token_ids))
        batch = self._host_batch(chunks)
        if self.state_slots is not None:  # (a drafting pass's batch has no states)
            self._assign_state_slots(chunks, batch)
        scoring = [(i, c.scoring) for i, c in enumerate(chunks) if c.scoring is not None]
        sampling = [(i, c) for i, c in enumerate(chunks) if c.sampling is not None]
        # Each sampling chunk's last token, or with drafts its last 1 + num_drafts tokens.
        positions = [
            row
            for i, c in sampling
            for row in range(batch.query_start_loc[i + 1] - c.sampling.num_positions,
                             batch.query_start_loc[i + 1])
        ]  # fmt: skip
        # The rows of each logits pass, in the order they run: every rank runs them (each
        # computes its slice of the vocabulary, rank 0 gathers), so the plan travels with
        # the batch. Scoring passes first, one per score_passes slice; then sampling.
        plan = [
            list(range(first + rows.start, first + rows.stop))
            for i, score in scoring
            for first in [batch.query_start_loc[i] + score.first_row]
            for rows in score_passes(len(score.target_token_ids))
        ]
        if positions:
            plan.append(positions)
        pooled = [(i, c) for i, c in enumerate(chunks) if c.pooling is not None]
        classified = [(i, c) for i, c in pooled if c.pooling.token_ids]  # logits, last
        if classified:
            plan.append([batch.query_start_loc[i + 1] - 1 for i, _ in classified])
        try:  # from the step's message to its last collective
            hidden = self._forward(chunks, batch, plan)
            passes = (self.model.compute_logits(hidden[rows]) for rows in plan)  # [rows, vocab]
            for i, score in scoring:
                result.prompt_logprobs[chunks[i].request_id] = score_tokens(
                    passes, score.target_token_ids, score.num_top
                )
            logits = next(passes) if sampling else None  # [num_positions, vocab]
            classify_logits = next(passes) if classified else None  # [len(classified), vocab]
        except BaseException as exc:
            self._fail_shards(exc)
            raise
        embedded = [(i, c) for i, c in pooled if not c.pooling.token_ids]
        if embedded:  # each one's last row (rank 0's hidden states are whole)
            vectors = pool_last_tokens(
                hidden,
                [batch.query_start_loc[i + 1] - 1 for i, _ in embedded],
                [c.pooling.normalize for _, c in embedded],
            )
            result.embeddings = {
                c.request_id: v for (_, c), v in zip(embedded, vectors, strict=True)
            }
        if classify_logits is not None:
            token_ids = [c.pooling.token_ids for _, c in classified]
            picked = pick_token_logits(classify_logits, token_ids)
            result.embeddings.update(
                (c.request_id, v) for (_, c), v in zip(classified, picked, strict=True)
            )
        if logits is not None:
            results = sample(logits, [c.sampling for _, c in sampling])
            sampled = zip(sampling, results, strict=True)
            result.sampled = {c.request_id: r for (_, c), r in sampled}
        if self.shard.num_draft_layers or self.draft is not None:
            self._model_drafts(chunks, batch, result)
        if self.expert_rebalance_interval:
            self._steps_since_rebalance += 1
            if self._steps_since_rebalance == self.expert_rebalance_interval:
                self._steps_since_rebalance = 0
                self._rebalance_experts()
        return result

    def _rebalance_experts(self) -> None:
        """Place each expert-parallel layer's experts by the pairs routed since the last
        rebalance (``expert_placement.rebalance``), on every rank (the others told first)."""
        loads = self.shard.take_expert_load().tolist()  # [layers][experts]
        old = self.shard.expert_placements()
        num_ranks = self.tp.size
        new = [rebalance(load, now, num_ranks) for load, now in zip(loads, old, strict=True)]
        before, after = imbalance(loads, old, num_ranks), imbalance(loads, new, num_ranks)
        moved = 0
        if after < before:  # else moving experts would not pay for itself
            if self.shards is not None:
                self.shards.send(PlaceExperts([list(placement) for placement in new]))
            try:
                moved = self.shard.place_experts(new)
            except BaseException as exc:
                self._fail_shards(exc)
                raise
        after = min(after, before)  # the placement kept, when no other is better
        balance = self.expert_balance
        self.expert_balance = ExpertBalance(
            balance.num_rebalances + 1, balance.num_moved_slots + moved, before, after
        )
        logger.info(
            "experts rebalanced by the last %d steps' %d routed pairs: imbalance %.3f -> %.3f "
            "(busiest rank over mean), %d expert slots moved",
            self.expert_rebalance_interval, int(sum(map(sum, loads))), before, after, moved,
        )  # fmt: skip

    def _model_drafts(
        self,
        chunks: list[SequenceChunk],
        batch: HostBatch,
        result: StepResult,
    ) -> None:
        """The MTP layer's or the draft model's passes after a step (``mtp_drafts.py``,
        ``draft_model.py``): ``result.drafts``, each drafting request's drafts, and with a
        draft model ``result.draft_kv_end``."""
        segments = []
        for i, chunk in enumerate(chunks):
            tokens = result.sampled.get(chunk.request_id)
            known = None if tokens is None else [token for token, _ in tokens]
            first_row = batch.query_start_loc[i]
            if self.draft is None:
                segment = mtp_segment(chunk, known, first_row)
            else:
                capacity = slots_end(chunk.block_ids, self.block_size, self.max_model_len)
                segment = draft_segment(chunk, known, first_row, capacity)
                if segment is not None:
                    end = segment.start_pos + len(segment.token_ids)
                    result.draft_kv_end[chunk.request_id] = end
            if segment is not None and segment.token_ids:
                segments.append(segment)
        if not segments:
            return
        run_pass = self._mtp_pass if self.draft is None else self.draft.run_pass
        result.drafts = propose_drafts(
            run_pass, self._host_batch, segments, self.block_size, self.max_model_len
        )

    def _mtp_pass(
        self, batch: HostBatch, hidden_rows: list[int], from_target: bool, logit_rows: list[int]
    ) -> torch.Tensor | None:
        """``ModelShard.mtp_pass`` on every rank (the others told first)."""
        if self.shards is not None:
            self.shards.send(
                MtpPass(*_wire_batch(batch), hidden_rows, from_target, logit_rows)
            )  # fmt: skip
        try:
            return self.shard.mtp_pass(batch, hidden_rows, from_target, logit_rows)
        except BaseException as exc:
            self._fail_shards(exc)
            raise


@dataclass(frozen=True, slots=True)
class ExpertBalance:
    """Expert parallelism's rebalancing so far (``ModelRunner.expert_balance``)."""

    num_rebalances: int = 0
    num_moved_slots: int = 0  # expert slots, all ranks' and layers', that changed expert
    # ``expert_placement.imbalance`` of the last window's load under the placement that
    # ran it, and under the one chosen for the next (1.0: perfect).
    imbalance: float = 1.0
    imbalance_rebalanced: float = 1.0


def rope_positions(
    positions: list[int], chunks: list[SequenceChunk] | list[MtpSegment]
) -> tuple[list[int] | None, np.ndarray | None]:
    """``HostBatch.rope_positions`` and ``mrope_positions`` of a step: None, None where
    every chunk's rotary positions are its sequence positions; else one per token where
    each token's three agree (decodes past their prompts: graphs may replay them), or
    [3, num_tokens] (the other chunks' positions repeated on the three rows)."""
    if all(getattr(chunk, "rope_positions", None) is None for chunk in chunks):
        return None, None
    parts = []
    for chunk in chunks:
        given = getattr(chunk, "rope_positions", None)
        if given is None:
            count = len(chunk.token_ids)
            given = np.broadcast_to(np.arange(chunk.start_pos, chunk.start_pos + count), (3, count))
        parts.append(given)
    rows = np.concatenate(parts, axis=1)  # [3, num_tokens]
    assert rows.shape[1] == len(positions), (rows.shape, len(positions))
    if (rows[0] == rows[1]).all() and (rows[0] == rows[2]).all():
        return rows[0].tolist(), None
    return None, np.ascontiguousarray(rows, dtype=np.int64)


def _wire_batch(batch: HostBatch) -> tuple:
    """``batch``'s fields as the first fields of ``Step`` and ``MtpPass``."""
    return (
        batch.input_ids, batch.positions, batch.slot_mapping, batch.query_start_loc,
        batch.seq_lens, batch.block_table.numpy().tobytes(), batch.block_table.shape[1],
    )  # fmt: skip
