"""One paged-attention engine's settings (``EngineConfig``, a worker role's ``engine``
section) and the enums its fields take. Torch-free, as every config module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from common.config_base import ConfigError, coerce_enums


class AttentionBackendName(StrEnum):
    AUTO = "auto"  # triton on CUDA, torch elsewhere
    TORCH = "torch"
    TRITON = "triton"


class SpeculativeMethod(StrEnum):
    """Who proposes the drafts that ``num_speculative_tokens`` verifies."""

    NGRAM = "ngram"  # lookup in the request's own tokens (engine/ngram_proposer.py)
    # The checkpoint's multi-token-prediction layer (DeepSeek-V3, GLM-4.5), run after each
    # step on the target's hidden states, with a KV cache of its own (engine/models/mtp.py).
    MTP = "mtp"
    # A small model of the same tokenizer (``engine.draft_model``), run after each step on
    # rank 0 with a KV cache of its own (engine/draft_model.py): vLLM's draft-model method.
    DRAFT_MODEL = "draft_model"
    # An EAGLE-3 head (``engine.draft_model``): one decoder layer run like the MTP layer,
    # on three of the target's hidden states (engine/models/eagle3.py); vLLM's eagle3.
    EAGLE3 = "eagle3"

    @property
    def drafts_after_step(self) -> bool:
        """Whether the runner computes the drafts right after each step (a model on the
        device), rather than the scheduler from the request's tokens (ngram)."""
        return self is not SpeculativeMethod.NGRAM

    @property
    def reads_target_states(self) -> bool:
        """Whether the drafts come from a layer fed the target's hidden states (MTP,
        EAGLE-3), with a KV cache layer beside the target's."""
        return self in (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE3)

    @property
    def reads_draft_model(self) -> bool:
        """Whether ``engine.draft_model`` names what drafts (a draft model, an EAGLE-3 head)."""
        return self in (SpeculativeMethod.DRAFT_MODEL, SpeculativeMethod.EAGLE3)


class DType(StrEnum):
    # On CUDA the checkpoint's 16-bit dtype (bfloat16 for a float32 checkpoint); float32
    # on CPU (no fast bf16 there).
    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Device(StrEnum):
    AUTO = "auto"  # cuda when available
    CPU = "cpu"
    CUDA = "cuda"


class KVCacheDType(StrEnum):
    """What the KV cache stores (vLLM's ``--kv-cache-dtype`` names). FP8 halves the KV
    bytes of a 16-bit model (a quarter of float32): twice the tokens cached in the same
    memory and half the bytes moved from prefill to decode, for rounding each K/V element
    to 3 (e4m3) or 2 (e5m2) mantissa bits. Values are stored unscaled (a scale of 1.0, as
    vLLM does without calibrated scales), saturating at the format's largest finite
    value; attention computes in the model dtype after reading them."""

    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # = fp8_e4m3
    FP8_E4M3 = "fp8_e4m3"  # float8_e4m3fn: more precision, max 448
    FP8_E5M2 = "fp8_e5m2"  # float8_e5m2: more range (max 57344), less precision

    @property
    def storage_name(self) -> str | None:
        """The torch dtype name of the cache (``KVLayout.dtype``); None: the model's."""
        return {
            KVCacheDType.FP8: "float8_e4m3fn",
            KVCacheDType.FP8_E4M3: "float8_e4m3fn",
            KVCacheDType.FP8_E5M2: "float8_e5m2",
        }.get(self)


SOME_16_BIT = "a 16-bit dtype (the checkpoint's)"


def compute_dtype(engine: EngineConfig) -> str | None:
    """The dtype ``engine`` computes in (and, with ``kv_cache_dtype`` auto, its KV cache
    holds), as far as the config says (None: unknown)."""
    if engine.dtype is not DType.AUTO:
        return engine.dtype.value
    return {Device.CPU: "float32", Device.CUDA: SOME_16_BIT}.get(engine.device)


def max_model_len_problem(max_model_len: int, context_len: int) -> str | None:
    """Why a ``max_model_len`` cannot be served by a model whose context is
    ``context_len`` tokens (None: it can). Said by the engine and by ``config check``."""
    if max_model_len <= context_len:
        return None
    return (f"{max_model_len} is beyond the model's context of {context_len} tokens (its "
            "max_position_embeddings, or what its rope scaling reaches); set at most "
            f"{context_len}, or leave it unset for {context_len}")  # fmt: skip


class StateDType(StrEnum):
    """What a hybrid model's linear-attention states are kept in (``engine/linear_state.py``):
    float32 (exact; transformers' float32 models, and FLA's Qwen3.5 kernels, carry float32
    states), or 16 bits: half the memory per request slot and half the bytes a pull moves,
    for rounding the states once per step (vLLM's default for 16-bit models). Both roles
    must agree: the states move between them byte for byte."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        return 4 if self is StateDType.FLOAT32 else 2


class SchedulingPolicy(StrEnum):
    """The order in which an engine serves its requests (vLLM's ``--scheduling-policy``)."""

    FCFS = "fcfs"  # arrival order; a request's ``priority`` must be 0
    # Lowest ``priority`` value first, arrival order among equals. A waiting request may
    # preempt running ones of a strictly larger value to get a batch slot or KV blocks.
    PRIORITY = "priority"


# A request's priority travels as a protobuf int32.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


# Drafts verified per step and sequence: more only burns compute on rejected tokens.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one paged-attention engine; the same for both worker roles."""

    dtype: DType = DType.AUTO
    device: Device = Device.AUTO
    block_size: int = 16
    # KV blocks in the pool. None: sized from kv_cache_bytes (CPU) or
    # gpu_memory_utilization (CUDA) after the weights are loaded.
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    # This instance's share of its GPU, for its weights and KV cache (vLLM's meaning: two
    # workers at 0.4 share a card); activations and graphs come out of the rest.
    gpu_memory_utilization: float = 0.85
    # None: the checkpoint's context (max_position_embeddings; with YaRN, the pretraining
    # context times its factor: common.hf_config.max_context_len). Larger is a ConfigError.
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Most prompt tokens one request may compute in one step. None: only the step budget
    # limits it. Small values interleave long prompts with decodes more finely.
    prefill_chunk_tokens: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: AttentionBackendName = AttentionBackendName.AUTO
    # Replay decode steps from CUDA graphs (CUDA with the triton backend only).
    cuda_graphs: bool = True
    seed: int = 0
    # Bytes of CPU memory for offloaded KV blocks (the deployment's offload.cpu_bytes);
    # 0: evicted blocks are dropped.
    cpu_offload_bytes: int = 0
    # A vision-language model's encoder output for recent images (by digest), on its
    # device: an image seen again whose placeholders are not all prefix-cached (another
    # question after it, a prompt's last block) is not encoded again. 0: none kept.
    encoder_cache_bytes: int = 128 << 20
    # A worker whose engine spends longer than this in one step (or command) takes its
    # device for hung: it fails its requests and exits to be restarted. None: never.
    # Generous, since a big prefill chunk of a large model on a CPU can take minutes.
    step_timeout_s: float | None = 300.0
    # Speculative decoding by n-gram lookup (vLLM's "ngram" method, prompt lookup): each
    # decode step proposes up to this many tokens by finding the sequence's last
    # ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens earlier in it and copying what
    # followed, and verifies them in the same forward pass. It never changes the tokens (a
    # draft is kept only if it is the token the request would have sampled there, greedy
    # or seeded); it pays off where outputs repeat their context (code edits, extraction,
    # summaries). 0: off. Decode workers use it; a prefill worker samples one token.
    num_speculative_tokens: int = 0
    # ``mtp``: the drafts come from the checkpoint's multi-token-prediction layer instead.
    # It runs, and keeps its KV (one more cache layer), whenever this is mtp, even with
    # num_speculative_tokens 0: a prefill worker writes the prompt's MTP KV that its decode
    # workers' drafts attend to, so both roles need the same method (eagle3 likewise).
    speculative_method: SpeculativeMethod = SpeculativeMethod.NGRAM
    # ``draft_model``: the checkpoint directory of the draft (a smaller model whose token
    # ids are the target's: Llama-3.2-1B for Llama-3.1-70B, Qwen2.5-0.5B for Qwen2.5-32B).
    # Its KV cache shares the target's block ids, so each block costs both models' bytes.
    # ``eagle3``: the EAGLE-3 head's directory (safetensors); its KV is one more layer.
    draft_model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Tensor parallelism: the model's heads and MLP widths split over this many devices
    # (GPUs 0..N-1 of the worker's visible ones; CPU processes on a CPU engine, for tests),
    # one process each, summing partial results with all-reduces (NCCL; gloo on CPU).
    # Memory per device (num_blocks, kv_cache_bytes, gpu_memory_utilization,
    # cpu_offload_bytes) is per rank. KV transfer needs the same size on both roles.
    tensor_parallel_size: int = 1
    # With tensor parallelism, give each rank whole routed experts (rank r: experts
    # r * E / N .. (r + 1) * E / N) instead of a 1/N slice of every expert's width, as
    # vLLM's --enable-expert-parallel: each rank runs only the tokens routed to its
    # experts, in full-width matmuls, and the layer's all-reduce adds the ranks' parts.
    # Attention, dense and shared-expert MLPs stay split by heads and widths.
    expert_parallel: bool = False
    # Expert parallelism's balance (DeepSeek's EPLB, vLLM's --enable-eplb). Redundant
    # experts: extra slots that hold copies of experts, so a popular expert's tokens are
    # shared by the ranks holding it; each rank then holds (E + R) / N experts. Rebalance
    # interval: every this many steps, the routed-token counts since the last rebalance
    # choose how many copies each expert gets and which rank holds each (the heaviest
    # first, to the least-loaded rank), and the ranks exchange the experts that moved.
    # 0: the placement stays as loaded (copies of experts 0..R-1, spread so that equal
    # loads are shared equally).
    num_redundant_experts: int = 0
    expert_rebalance_interval: int = 0
    # What the KV cache stores: the model's dtype, or FP8 (``KVCacheDType``). Both roles
    # must agree: KV blocks move between them byte for byte.
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    # What a hybrid model's linear-attention states are kept in (``StateDType``).
    linear_state_dtype: StateDType = StateDType.FLOAT32
    # A hybrid model verifying drafts keeps its states after each of a request's
    # num_speculative_tokens verified tokens in slots of their own until its next step:
    # at most this many requests verify drafts at once (the rest decode one token that
    # step), so the pool holds this many groups of draft slots. None: max_num_seqs (every
    # request may). Each group costs num_speculative_tokens slots of states (Granite-4.0-H-
    # Small's: 148 MiB each in float32). Other models keep no draft states: unused there.
    max_num_verifying_seqs: int | None = None
    # Who goes first when not everyone fits (``SchedulingPolicy``): arrival order, or the
    # requests' ``priority`` (then high-priority traffic also preempts low-priority).
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self) -> None:
        coerce_enums(self)
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "engine.num_speculative_tokens",
                f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}",
            )
        method = self.speculative_method
        if method.reads_draft_model and not self.draft_model:
            raise ConfigError(
                "engine.draft_model",
                f"speculative_method {method.value} needs the draft's checkpoint directory",
            )
        if self.draft_model and not method.reads_draft_model:
            raise ConfigError(
                "engine.draft_model",
                f"is used only with speculative_method draft_model or eagle3, not {method.value}",
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "engine.prompt_lookup_min",
                "must be >= 1 and <= engine.prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}",
            )
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes",
                    "tensor_parallel_size")  # fmt: skip
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(f"engine.{key}", f"must be > 0, got {getattr(self, key)}")
        if self.cpu_offload_bytes < 0:
            raise ConfigError("engine.cpu_offload_bytes", "must be >= 0")
        if self.encoder_cache_bytes < 0:
            raise ConfigError("engine.encoder_cache_bytes", "must be >= 0")
        if self.max_num_verifying_seqs is not None and not (
            1 <= self.max_num_verifying_seqs <= self.max_num_seqs
        ):
            raise ConfigError(
                "engine.max_num_verifying_seqs",
                f"must be in [1, max_num_seqs={self.max_num_seqs}] or null, got "
                f"{self.max_num_verifying_seqs}",
            )
        for key in ("num_blocks", "max_model_len", "prefill_chunk_tokens", "step_timeout_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"engine.{key}", f"must be > 0 or null, got {value}")
        for key in ("num_redundant_experts", "expert_rebalance_interval"):
            value = getattr(self, key)
            if value < 0:
                raise ConfigError(f"engine.{key}", f"must be >= 0, got {value}")
            if value and not (self.expert_parallel and self.tensor_parallel_size > 1):
                raise ConfigError(
                    f"engine.{key}",
                    "balances expert parallelism: needs engine.expert_parallel and "
                    f"tensor_parallel_size > 1 (got {self.tensor_parallel_size})",
                )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "engine.gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}",
            )

    @property
    def num_draft_state_groups(self) -> int:
        """Groups of draft state slots a hybrid model's pool holds (``max_num_verifying_seqs``):
        none without speculation."""
        if not self.num_speculative_tokens:
            return 0
        return self.max_num_verifying_seqs or self.max_num_seqs

    def replace(self, **changes: Any) -> EngineConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"engine.{sorted(unknown)[0]}", "unknown engine setting")
        return dataclasses.replace(self, **changes)

    def hybrid_problem(self) -> tuple[str, str] | None:
        """(key, reason) of a setting a hybrid model (linear-attention layers:
        ``engine/linear_state.py``) cannot run with yet, or None. Drafts of the n-gram
        proposer, a draft model or the checkpoint's MTP layer are verified (each verified
        token's states kept until the sampler has chosen: ``LinearStep.verify``); an
        EAGLE-3 head over a hybrid target is untried."""
        if self.speculative_method is SpeculativeMethod.EAGLE3:
            return (
                "speculative_method",
                "eagle3 drafts are not supported for models with linear-attention layers "
                "(ngram, draft_model and mtp are)",
            )
        return None
