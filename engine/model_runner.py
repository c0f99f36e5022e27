"""Owns the model and the KV cache tensors; turns one step's chunks into one forward pass.

Per step the runner builds a single flattened batch (``input_ids``, ``positions``,
``slot_mapping``, block table, query start offsets, sequence lengths), runs the model,
computes logits only at the last token of chunks that sample (and at their draft tokens,
when they verify drafts; and at the prompt tokens of chunks that score their prompt), and
samples.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import ConfigError, EngineConfig
from engine.attention.backend import BatchLayout
from engine.attention.registry import create_backend
from engine.cuda_graphs import DecodeGraphs
from engine.host_memory import zeros_for_kv_caches
from engine.models.arch import ModelArchConfig
from engine.models.loader import load_model
from engine.models.lora import LoraAdapter, LoraBatch, load_lora_adapter
from engine.request import TokenLogprobs
from engine.sampler import SamplingRow, sample, score_tokens

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceChunk:
    """The tokens one request computes this step."""

    request_id: str
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]: the request's num_computed_tokens
    block_ids: list[int]  # every block of the request, covering start_pos + len(token_ids)
    sampling: SamplingRow | None  # None: a prompt chunk that is not the last
    scoring: PromptScoring | None = None
    lora: LoraAdapter | None = None  # the request's LoRA adapter; None: the base model


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


@dataclass(slots=True)
class HostBatch:
    """One step's flattened batch as host lists, before it becomes device tensors."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_rows: list[list[int]] = field(default_factory=list)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    ) -> None:
        """``lora_adapters``: name -> PEFT adapter directory, loaded now; more may be
        added and removed later (``LLMEngine.add_lora_adapter``). A chunk carries its
        request's adapter object (``SequenceChunk.lora``), not a name, so removing one
        from this table never pulls it from under a request that runs with it."""
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = create_backend(config.attention_backend, device, config.block_size)
        self.model = load_model(model_dir, arch, max_model_len, self.backend, device, dtype)
        self.lora_adapters: dict[str, LoraAdapter] = {
            name: self.read_lora_adapter(name, path) for name, path in (lora_adapters or {}).items()
        }
        self.num_blocks = self._num_blocks(config)
        shape = (self.num_blocks, 2, self.block_size, arch.num_kv_heads, arch.head_dim)
        # One view per layer of a block-major buffer; a block id names the same slot in
        # every layer (host_memory.zeros_for_kv_caches says why).
        self.kv_caches = zeros_for_kv_caches(arch.num_layers, shape, dtype, device)
        self.decode_graphs: DecodeGraphs | None = None
        if config.cuda_graphs and device.type == "cuda" and self.backend.name == "triton":
            self._capture(config)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
            self.backend.name,
        )

    def _capture(self, config: EngineConfig) -> None:
        graphs = DecodeGraphs(
            self.model, self.backend, self.kv_caches, config.max_num_seqs,
            self.max_model_len, self.block_size, self.device,
        )  # fmt: skip
        try:
            graphs.capture()
        except Exception as exc:  # eager steps still work: never fail the engine for this
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            return
        self.decode_graphs = graphs

    @property
    def bytes_per_block(self) -> int:
        arch = self.arch
        elements = arch.num_layers * 2 * self.block_size * arch.num_kv_heads * arch.head_dim
        return elements * torch.finfo(self.dtype).bits // 8

    def _num_blocks(self, config: EngineConfig) -> int:
        min_blocks = cdiv(self.max_model_len, self.block_size)
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif self.device.type == "cuda":
            # Memory torch's allocator caches but does not use counts as free.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - int(total * (1.0 - config.gpu_memory_utilization))
            num_blocks = budget // self.bytes_per_block
        else:
            num_blocks = config.kv_cache_bytes // self.bytes_per_block
        if num_blocks < min_blocks:
            raise ConfigError(
                "engine.num_blocks",
                f"{num_blocks} KV blocks cannot hold one request of max_model_len="
                f"{self.max_model_len} ({min_blocks} blocks of {self.block_size} tokens); "
                "give the KV cache more memory or lower engine.max_model_len",
            )
        return num_blocks

    def _host_batch(self, chunks: list[SequenceChunk]) -> HostBatch:
        bs = self.block_size
        batch = HostBatch()
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
            batch.block_rows.append(blocks[: cdiv(end, bs)])
        return batch

    def _layout(self, chunks: list[SequenceChunk], batch: HostBatch) -> BatchLayout:
        max_blocks = max(len(row) for row in batch.block_rows)
        table = [row + [0] * (max_blocks - len(row)) for row in batch.block_rows]
        return BatchLayout(
            slot_mapping=self._to_device(batch.slot_mapping, torch.int64),
            query_start_loc=self._to_device(batch.query_start_loc, torch.int32),
            seq_lens=self._to_device(batch.seq_lens, torch.int32),
            block_table=self._to_device(table, torch.int32),
            query_start_loc_cpu=batch.query_start_loc,
            seq_lens_cpu=batch.seq_lens,
            num_decodes=sum(1 for chunk in chunks if len(chunk.token_ids) == 1),
            max_query_len=max(len(c.token_ids) for c in chunks),
            max_seq_len=max(batch.seq_lens),
        )

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _forward(self, chunks: list[SequenceChunk], batch: HostBatch) -> torch.Tensor:
        """Hidden states of every token: replayed from a CUDA graph for decode-only steps
        that fit one, eagerly otherwise."""
        lora = self._lora_batch(chunks, batch)
        graphs = self.decode_graphs
        if (
            graphs is not None
            and lora is None  # graphs are captured for the base model
            and len(chunks) == len(batch.input_ids)
            and graphs.fits(len(chunks))
        ):
            return graphs.run(
                batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                batch.block_rows,
            )  # fmt: skip
        metadata = self.backend.build_metadata(self._layout(chunks, batch))
        input_ids = self._to_device(batch.input_ids, torch.int64)
        positions = self._to_device(batch.positions, torch.int64)
        return self.model(input_ids, positions, self.kv_caches, metadata, lora)

    def read_lora_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Read a PEFT adapter for this model onto its device (any thread: it touches
        nothing of the runner's); a bad one raises ``ModelLoadError``."""
        return load_lora_adapter(name, path, self.arch, self.device, self.dtype)

    def _lora_batch(self, chunks: list[SequenceChunk], batch: HostBatch) -> LoraBatch | None:
        """The rows of each adapter in this step; None when no chunk uses one."""
        rows: dict[LoraAdapter, list[int]] = {}  # by identity (eq=False)
        for i, chunk in enumerate(chunks):
            if chunk.lora is not None:
                start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
                rows.setdefault(chunk.lora, []).extend(range(start, end))
        if not rows:  # the common case: no per-step work at all
            return None
        return LoraBatch(
            tuple(
                (adapter, self._to_device(indices, torch.int64))
                for adapter, indices in rows.items()
            )
        )

    @torch.inference_mode()
    def execute(self, chunks: list[SequenceChunk]) -> StepResult:
        """Run one step: the sampled token (and log-probs) of each sampling chunk, and the
        prompt log-probs of each scoring one."""
        result = StepResult()
        if not chunks:
            return result
        # Shortest first: decodes lead (backends batch single-token segments together),
        # then short segments (decodes with drafts; the torch backend batches those too).
        chunks = sorted(chunks, key=lambda c: len(c.token_ids))
        batch = self._host_batch(chunks)
        hidden = self._forward(chunks, batch)
        for i, chunk in enumerate(chunks):
            if chunk.scoring is not None:
                scoring = chunk.scoring
                first = batch.query_start_loc[i] + scoring.first_row
                rows = hidden[first : first + len(scoring.target_token_ids)]
                result.prompt_logprobs[chunk.request_id] = score_tokens(
                    self.model.compute_logits, rows, scoring.target_token_ids, scoring.num_top
                )
        sampling = [(i, c) for i, c in enumerate(chunks) if c.sampling is not None]
        if not sampling:
            return result
        # Each sampling chunk's last token, or with drafts its last 1 + num_drafts tokens.
        positions = [
            row
            for i, c in sampling
            for row in range(batch.query_start_loc[i + 1] - c.sampling.num_positions,
                             batch.query_start_loc[i + 1])
        ]  # fmt: skip
        logits = self.model.compute_logits(hidden[positions])  # [num_positions, vocab]
        results = sample(logits, [c.sampling for _, c in sampling])
        result.sampled = {c.request_id: r for (_, c), r in zip(sampling, results, strict=True)}
        return result
