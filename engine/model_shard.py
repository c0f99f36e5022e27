"""One rank's model and KV cache: turns a step's flattened batch into hidden states.

Without tensor parallelism there is one rank, and this is the whole model. With it, every
rank of the group holds one of these (rank 0 inside ``ModelRunner``, the others in shard
processes, ``engine/parallel``), each with its heads' slice of the weights and of the KV
cache, and runs the same batch; the layers sum their partial outputs across ranks.

Built in two steps, because ranks must agree on the cache size before any allocates one:
``ModelShard(...)`` loads the weights and ``max_num_blocks`` says what this rank's memory
holds; ``allocate(num_blocks)`` then makes the KV cache (the same block count on every
rank, so a block id names the same tokens everywhere) and captures CUDA graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.config_base import ConfigError
from common.engine_config import EngineConfig, SpeculativeMethod
from common.intmath import cdiv
from engine.attention.backend import BatchLayout
from engine.attention.registry import create_backend
from engine.cuda_graphs import DecodeGraphs
from engine.host_memory import zeros_for_kv_caches
from engine.linear_state import LinearStep, StatePool, bytes_per_slot, verify_plan
from engine.models.arch import ModelArchConfig, ModelLoadError
from engine.models.eagle3 import Eagle3Head, load_eagle3_head
from engine.models.llama import use_kv_scales
from engine.models.loader import load_model
from engine.models.lora import LoraBatch
from engine.models.moe import SparseMoe
from engine.models.mtp import MtpLayer
from engine.parallel.expert_moves import move_experts
from engine.parallel.expert_placement import Placement
from engine.parallel.group import SingleRank, TPGroup
from engine.parallel.shard_spec import engine_split, local_arch
from kernels.reference import FP8_DTYPES

logger = logging.getLogger(__name__)

# Triton converts to float8_e4m3fn (its fp8e4nv) in hardware from sm_89 (Ada, Hopper) on.
MIN_CAPABILITY_E4M3 = (8, 9)


def kv_cache_dtype(
    config: EngineConfig, model_dtype: torch.dtype, device: torch.device, backend: str
) -> torch.dtype:
    """What the KV cache stores (``engine.kv_cache_dtype``). Raises ``ConfigError`` for
    FP8 e4m3 on a GPU whose Triton kernels cannot convert it."""
    name = config.kv_cache_dtype.storage_name
    if name is None:
        return model_dtype
    dtype = getattr(torch, name)
    if (
        dtype == torch.float8_e4m3fn
        and backend == "triton"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < MIN_CAPABILITY_E4M3
    ):
        raise ConfigError(
            "engine.kv_cache_dtype",
            f"fp8_e4m3 needs a GPU of compute capability 8.9 or newer for the triton "
            f"backend, this one is {torch.cuda.get_device_capability(device)}; use fp8_e5m2",
        )
    return dtype


@dataclass(slots=True)
class HostBatch:
    """One step's flattened batch on the host, before it becomes device tensors.
    Segments are ordered shortest first (decodes lead: ``BatchLayout``)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    # [num_seqs, max blocks of any sequence] int32: each sequence's block ids first, the
    # rest of its row unspecified (attention reads only the blocks of seq_lens[i]).
    block_table: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int32))
    # Per token, the end of the positions it attends to, where images attend both ways
    # (``BatchLayout.key_ends``); None: causal.
    key_ends: list[int] | None = None
    # Rotary positions where they are not ``positions`` (M-RoPE: ``engine/mrope.py``):
    # one per token where each token's three agree, else [3, num_tokens] int64.
    rope_positions: list[int] | None = None
    mrope_positions: np.ndarray | None = None
    # A hybrid model's: each sequence's state slot, and the slots whose states start from
    # zero this step (``engine/linear_state.py``); None: no linear-attention layers.
    state_slots: list[int] | None = None
    fresh_slots: list[int] | None = None
    # [slot, *block ids] each: slots whose states are copied from a cached snapshot's
    # blocks before the step, and slots copied into a snapshot's blocks after it.
    state_restores: list[list[int]] | None = None
    state_snapshots: list[list[int]] | None = None
    # [source, dest] each: slots whose states become another's before the step (a decode
    # that verified drafts: the states after the last token kept); and [sequence index,
    # *slots] each: a decode with drafts, the slots its states after each token but the
    # last go to (``LinearStep.verify``).
    state_accepts: list[list[int]] | None = None
    state_drafts: list[list[int]] | None = None

    @property
    def rotary_positions(self) -> list[int]:
        """Each token's rotary position (not with ``mrope_positions``)."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_decodes(self) -> int:
        """Single-token segments: they lead the batch (its segments go shortest first)."""
        return sum(1 for i in range(self.num_seqs) if self.query_len(i) == 1)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


# Of a card's memory, what the KV cache leaves free whatever the utilization (activations,
# graphs, the CUDA context, other processes' growth).
FREE_RESERVE = 0.05


def _cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes for this instance's KV cache: its share of the card (``utilization`` of it,
    vLLM's meaning) less what it holds already (its weights), and never past what is free
    less ``FREE_RESERVE`` of the card. It was "what is free, less (1 - utilization) of the
    card", which counted the other workers' memory against this one's share: two workers
    at 0.4 on one card (``benchmarks/GPU_RUNBOOK.md``'s 1P1D) left the second a negative
    budget (an audit). One worker alone gets what it got (a little more: its context)."""
    torch.cuda.empty_cache()  # (what the allocator caches but does not use counts as free)
    free, total = torch.cuda.mem_get_info(device)
    share = int(total * utilization) - torch.cuda.memory_reserved(device)
    return min(share, free - int(total * FREE_RESERVE))


class ModelShard:
    def __init__(
        self,
        model_dir: str | Path,
        arch: ModelArchConfig,  # the full model's
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        group: TPGroup | None = None,
    ) -> None:
        self.group = group or SingleRank()
        tp = engine_split(config, self.group.rank)
        self.arch = local_arch(arch, tp)
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        latent_widths = None
        if arch.mla is not None:
            latent_widths = (arch.mla.kv_lora_rank, arch.mla.qk_rope_head_dim)
        self.backend = create_backend(
            config.attention_backend, device, config.block_size, latent_widths
        )
        self.cache_dtype = kv_cache_dtype(config, dtype, device, self.backend.name)
        # A drafting layer (``engine/mtp_drafts.py``): the checkpoint's MTP layer or an
        # EAGLE-3 head; its KV is the last cache layer.
        method = config.speculative_method
        self.num_draft_layers = int(method.reads_target_states)
        self.model = load_model(
            model_dir, arch, max_model_len, self.backend, device, dtype, self.group,
            int(method is SpeculativeMethod.MTP), tp,
        )  # fmt: skip
        self.draft_layer: MtpLayer | Eagle3Head | None = None
        if method is SpeculativeMethod.MTP:
            self.draft_layer = self.model.model.mtp_layers[0]
        elif method is SpeculativeMethod.EAGLE3:
            assert config.draft_model is not None
            self.draft_layer = load_eagle3_head(
                config.draft_model, arch, max_model_len, self.backend, device, dtype,
                self.group, tp,
            )  # fmt: skip
        # What the drafting layer's first pass after a step reads of that step's tokens
        # ([num_tokens, hidden]; None without one): the MTP layer, the states after the
        # final norm; an EAGLE-3 head, its fc of the states entering its aux layers. And
        # the last pass's states at the rows that drafted, which the next pass continues
        # (``carried``: the MTP layer's after its norm, an EAGLE-3 head's before).
        self.target_features: torch.Tensor | None = None
        self.draft_hidden: torch.Tensor | None = None
        self._use_kv_scales()
        # The layers whose experts are placed over the group (expert parallelism); rank 0
        # counts the pairs routed to their experts when it rebalances them.
        self.moe_layers = [
            m for m in self.model.modules()
            if isinstance(m, SparseMoe) and m.expert_placement is not None
        ]  # fmt: skip
        if config.expert_rebalance_interval and self.group.rank == 0:
            for moe in self.moe_layers:
                moe.expert_load = torch.zeros(moe.moe.num_experts, dtype=torch.int64, device=device)
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs: DecodeGraphs | None = None
        # A hybrid model's linear-attention states: a slot per request the scheduler may
        # hold (running, pulling or held for a decode worker), each in KV blocks of its own
        # past the scheduler's (``engine/linear_state.py``); with speculation, a group of
        # one per draft for each request that may verify drafts at once (``draft_slots``).
        linear = self.arch.linear_attention
        self.num_request_slots = config.max_num_seqs if linear is not None else 0
        self.num_draft_groups = config.num_draft_state_groups if linear is not None else 0
        self.num_state_slots = (
            self.num_request_slots + self.num_draft_groups * config.num_speculative_tokens
        )
        self.state_dtype = getattr(torch, config.linear_state_dtype.value)
        self.blocks_per_slot = (
            cdiv(bytes_per_slot(linear, self.state_dtype), self.bytes_per_block)
            if linear is not None
            else 0
        )
        self.state_pool: StatePool | None = None

    def draft_slots(self, group: int) -> list[int]:
        """The slots of draft group ``group`` (``linear_state.DraftGroups``), which keep a
        request's states after each draft-verifying token but the last: the state pool's
        slots past the requests' own."""
        k = self.config.num_speculative_tokens
        first = self.num_request_slots + group * k
        return list(range(first, first + k))

    def _use_kv_scales(self) -> None:
        """An FP8 cache stores K/V over the checkpoint's calibrated per-layer scales (as
        vLLM does with them); any other cache has no use for them."""
        scaled = self.model.checkpoint_kv_scales
        fp8 = self.cache_dtype in FP8_DTYPES
        if fp8 and self.model.kv_scale_problems:
            raise ModelLoadError(
                f"{self.model.kv_scale_problems[0]}: the checkpoint's KV-cache scales cannot "
                "serve an FP8 KV cache (engine.kv_cache_dtype: auto stores 16-bit K/V)"
            )
        if not scaled:
            return
        used = use_kv_scales(self.model) if fp8 else 0
        if self.group.rank != 0:  # one line per worker, not per rank
            return
        if fp8:
            if used:  # (it counted the layers that had scales, used or not)
                logger.info("the FP8 KV cache uses the checkpoint's calibrated K/V scales "
                            "(%d of %d layers)", used, self.arch.num_layers)  # fmt: skip
            if used < len(scaled):
                logger.warning(
                    "the checkpoint's K/V scales of %d layers are unused: latent attention "
                    "(MLA) and linear-attention layers store their cache unscaled, and a "
                    "layer index past the model's %d is none of its", len(scaled) - used,
                    self.arch.num_layers,
                )  # fmt: skip
        else:
            logger.info("the checkpoint's calibrated K/V scales are unused: the KV cache is "
                        "%s, not FP8 (engine.kv_cache_dtype)", self.cache_dtype)  # fmt: skip

    @property
    def num_cache_layers(self) -> int:
        """KV cache layers: the model's (a hybrid model's attention layers only), then the
        drafting layer's when it drafts."""
        return len(self.arch.kv_layers) + self.num_draft_layers

    @property
    def bytes_per_block(self) -> int:
        """This rank's bytes of one block (its KV heads, every cache layer)."""
        arch = self.arch
        elements = self.num_cache_layers * 2 * self.block_size * arch.num_kv_heads * arch.head_dim
        return elements * self.cache_dtype.itemsize

    def max_num_blocks(self, draft_bytes_per_block: int = 0) -> int:
        """The blocks this rank's memory holds (``engine.num_blocks`` if set), each of
        ``bytes_per_block`` and ``draft_bytes_per_block`` (a draft model's KV, on rank 0).
        Raises ``ConfigError`` if that is not one request of ``max_model_len``."""
        config = self.config
        min_blocks = cdiv(self.max_model_len, self.block_size)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = config.kv_cache_bytes
            if self.device.type == "cuda":
                budget = _cuda_kv_budget(self.device, config.gpu_memory_utilization)
            num_blocks = budget // (self.bytes_per_block + draft_bytes_per_block)
            # A hybrid model's linear-attention states come out of the same memory.
            num_blocks -= self.num_state_slots * self.blocks_per_slot
        if num_blocks < min_blocks:
            if config.num_blocks is not None:
                key = "engine.num_blocks"
            elif self.device.type == "cuda":
                key = "engine.gpu_memory_utilization"
            else:
                key = "engine.kv_cache_bytes"  # (what sized it: num_blocks was not set)
            raise ConfigError(
                key,
                f"{num_blocks} KV blocks cannot hold one request of max_model_len="
                f"{self.max_model_len} ({min_blocks} blocks of {self.block_size} tokens); "
                "give the KV cache more memory or lower engine.max_model_len",
            )
        return num_blocks

    def allocate(self, num_blocks: int) -> None:
        """Make the KV cache of ``num_blocks`` and capture decode graphs. Under tensor
        parallelism every rank calls this with the same count, at the same time (the
        capture runs collectives)."""
        arch = self.arch
        self.num_blocks = num_blocks
        num_state_blocks = self.num_state_slots * self.blocks_per_slot
        shape = (num_blocks + num_state_blocks, 2, self.block_size, arch.num_kv_heads,
                 arch.head_dim)  # fmt: skip
        # One view per layer of a block-major buffer; a block id names the same slot in
        # every layer (host_memory.zeros_for_kv_caches says why). A hybrid model's states
        # take the blocks past ``num_blocks``, which the scheduler never hands out.
        self.kv_caches = zeros_for_kv_caches(
            self.num_cache_layers, shape, self.cache_dtype, self.device
        )
        if arch.linear_attention is not None:
            self.state_pool = StatePool(
                arch.linear_attention, self.num_state_slots, self.kv_caches, num_blocks,
                self.blocks_per_slot, self.state_dtype,
            )  # fmt: skip
        config = self.config
        # Latent attention decodes eagerly: its capture is not yet tried on a GPU; so do
        # drafting layers (a graph keeps none of the states they read but its output).
        graphs = (
            config.cuda_graphs
            and self.device.type == "cuda"
            and arch.mla is None
            and not self.num_draft_layers
            and arch.linear_attention is None  # its layers index states by the step's slots
        )
        if graphs and self.backend.name == "triton":
            self._capture()
            self.take_expert_load()  # the capture's dummy batches routed nothing real
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB of %s%s), attention backend %s",
            num_blocks, self.block_size, num_blocks * self.bytes_per_block / 2**20,
            str(self.cache_dtype).removeprefix("torch."),
            f" on rank {self.group.rank} of {self.group.size}" if self.group.size > 1 else "",
            self.backend.name,
        )  # fmt: skip

    def _capture(self) -> None:
        counting = [moe for moe in self.moe_layers if moe.expert_load is not None]
        graphs = DecodeGraphs(
            self.model, self.backend, self.kv_caches, self.config.max_num_seqs,
            self.max_model_len, self.block_size, self.device, counting,
        )  # fmt: skip
        try:
            graphs.capture()
            captured = True
        except Exception as exc:  # eager steps still work: never fail the engine for this
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            captured = False
        # Every rank must replay or none: a step's collectives must match across ranks.
        if self.group.min_int(int(captured)):
            self.decode_graphs = graphs

    def uses_graph(
        self, batch: HostBatch, lora: object | None, images: object | None = None
    ) -> bool:
        """Whether ``forward`` replays a graph: decode-only steps of the base model
        without image rows that fit one. A function of the batch alone, so every rank
        decides alike."""
        graphs = self.decode_graphs
        return (
            graphs is not None
            and lora is None  # graphs are captured for the base model
            and images is None
            and batch.mrope_positions is None
            and batch.num_seqs == len(batch.input_ids)
            and graphs.fits(batch.num_seqs)
        )

    def forward(
        self,
        batch: HostBatch,
        lora: LoraBatch | None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states of every token [num_tokens, hidden_size] (after the final norm):
        replayed from a CUDA graph for decode-only steps that fit one, eagerly else.
        ``images``: (rows [m], embeddings [m, hidden]) that replace those rows' token
        embeddings (``engine/images.py``); under tensor parallelism rank 0's embeddings,
        which the other ranks receive into theirs."""
        if images is not None and self.group.size > 1:  # rank 0 encoded them
            rows, embeds = images
            images = (rows, self.group.broadcast(embeds.contiguous(), src=0))
        if self.uses_graph(batch, lora, images):
            assert self.decode_graphs is not None
            return self.decode_graphs.run(
                batch.input_ids, batch.rotary_positions, batch.slot_mapping, batch.seq_lens,
                batch.block_table,
            )  # fmt: skip
        input_ids, positions, metadata = self._device_inputs(batch)
        layer_caches = self._layer_caches(batch)
        layer = self.draft_layer
        if layer is None:
            hidden = self.model(input_ids, positions, layer_caches, metadata, lora, images)
        else:
            hidden, aux = self.model.hidden_and_aux(
                input_ids, positions, layer_caches, metadata, lora, layer.aux_layer_ids, images
            )
            hidden = self.model.model.norm(hidden)
            self.target_features = layer.features(hidden, aux)
        for slot, *block_ids in batch.state_snapshots or ():  # a hybrid model's, kept
            assert self.state_pool is not None
            self.state_pool.snapshot(slot, block_ids)
        return hidden

    def _layer_caches(self, batch: HostBatch) -> list:
        """Each layer's cache for a step: its KV cache, or a linear-attention layer's
        states (those of slots starting over zeroed first), or None (an MLP-only layer)."""
        kv_caches = self.kv_caches[: len(self.arch.kv_layers)]
        pool = self.state_pool
        if pool is None:
            return kv_caches
        assert batch.state_slots is not None and batch.fresh_slots is not None
        for source, dest in batch.state_accepts or ():
            pool.copy_slot(source, dest)
        pool.clear(batch.fresh_slots)
        for slot, *block_ids in batch.state_restores or ():
            pool.restore(slot, block_ids)
        plan = None
        if batch.state_drafts:
            draft_slots = {seq: slots for seq, *slots in batch.state_drafts}
            plan = verify_plan(draft_slots, batch.state_slots, batch.query_start_loc, self.device)
        step = LinearStep(
            slots=self.to_device(batch.state_slots, torch.int64),
            slots_cpu=batch.state_slots,
            query_start_loc_cpu=batch.query_start_loc,
            num_decodes=batch.num_decodes,
            verify=plan,
        )
        kv = iter(kv_caches)
        linear = iter(range(len(self.arch.linear_layers)))
        arch = self.arch
        return [
            pool.layer(next(linear), step) if arch.is_linear(i)
            else None if arch.is_mlp_only(i) else next(kv)
            for i in range(arch.num_layers)
        ]  # fmt: skip

    def mtp_pass(
        self, batch: HostBatch, hidden_rows: list[int], from_target: bool, logit_rows: list[int]
    ) -> torch.Tensor | None:
        """One pass of the drafting layer over ``batch`` (its input ids: the token after
        each position), fed rows ``hidden_rows`` of the last step's ``target_features``
        (``from_target``) or of the last pass's ``logit_rows`` states; writes the layer's
        KV at the batch's slots. Returns the logits of rows ``logit_rows``
        ([len, vocab] float32; rank 0's are the whole vocabulary's), None if there are
        none. Every rank of a tensor-parallel group runs the same passes."""
        layer = self.draft_layer
        source = self.target_features if from_target else self.draft_hidden
        assert layer is not None and source is not None
        previous = source[self.to_device(hidden_rows, torch.int64)]  # [num_tokens, hidden]
        input_ids, positions, metadata = self._device_inputs(batch)
        hidden = layer.draft_hidden(
            self.model, input_ids, positions, previous, self.kv_caches[-1], metadata
        )
        if not logit_rows:
            self.draft_hidden = None
            return None
        kept = hidden[self.to_device(logit_rows, torch.int64)]
        self.draft_hidden = layer.carried(kept)
        return layer.draft_logits(self.model, kept)

    def expert_placements(self) -> list[Placement]:
        """The placement each of ``moe_layers`` runs."""
        return [moe.expert_placement for moe in self.moe_layers]  # type: ignore[misc]

    def take_expert_load(self) -> torch.Tensor:
        """Pairs routed to each expert of each of ``moe_layers`` since the last call
        ([layers, num_experts] int64, on the host; counted on rank 0 with rebalancing
        on), and count from zero again."""
        counted = [moe.expert_load for moe in self.moe_layers if moe.expert_load is not None]
        if not counted:
            return torch.zeros(0, 0, dtype=torch.int64)
        loads = torch.stack(counted).cpu()
        for load in counted:
            load.zero_()
        return loads

    def place_experts(self, placements: list[Placement]) -> int:
        """Run ``placements`` (one per ``moe_layers``), exchanging experts with the other
        ranks, which call this with the same placements at the same time; returns the
        slots that changed expert."""
        assert len(placements) == len(self.moe_layers), (len(placements), len(self.moe_layers))
        return sum(
            move_experts(moe, placement, self.group)
            for moe, placement in zip(self.moe_layers, placements, strict=True)
        )

    def _device_inputs(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(input ids [n], positions [n], the backend's attention metadata) of ``batch``."""
        metadata = self.backend.build_metadata(self._layout(batch))
        input_ids = self.to_device(batch.input_ids, torch.int64)
        if batch.mrope_positions is not None:  # [3, num_tokens]
            positions = torch.from_numpy(batch.mrope_positions).to(self.device, non_blocking=True)
        else:
            positions = self.to_device(batch.rotary_positions, torch.int64)
        return input_ids, positions, metadata

    def _layout(self, batch: HostBatch) -> BatchLayout:
        query_lens = [batch.query_len(i) for i in range(batch.num_seqs)]
        key_ends = batch.key_ends
        return BatchLayout(
            slot_mapping=self.to_device(batch.slot_mapping, torch.int64),
            query_start_loc=self.to_device(batch.query_start_loc, torch.int32),
            seq_lens=self.to_device(batch.seq_lens, torch.int32),
            block_table=batch.block_table.to(self.device, non_blocking=True),
            query_start_loc_cpu=batch.query_start_loc,
            seq_lens_cpu=batch.seq_lens,
            num_decodes=batch.num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(batch.seq_lens),
            key_ends=None if key_ends is None else self.to_device(key_ends, torch.int32),
        )

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
