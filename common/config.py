"""Configuration schema. Torch-free, so the router and the CLI can validate without torch.

Each process builds its config once at its entry point and hands the fields down; configs
are frozen. Enum-typed fields accept their string values and are converted on construction,
so a config read from YAML and one written in Python compare equal.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from common.hosts import (
    HostError,
    IPAddress,
    addresses_overlap,
    host_addresses,
    ip_literal,
)
from common.redis_url import redis_url_problem


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or impossible. Names the dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


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


_SOME_16_BIT = "a 16-bit dtype (the checkpoint's)"
# A host name as a URL names it (an IPv6 address in brackets is not one here).
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}[A-Za-z0-9_])?"  # (_: compose's service names)
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def _compute_dtype(engine: EngineConfig) -> str | None:
    """The dtype ``engine`` computes in (and, with ``kv_cache_dtype`` auto, its KV cache
    holds), as far as the config says (None: unknown)."""
    if engine.dtype is not DType.AUTO:
        return engine.dtype.value
    return {Device.CPU: "float32", Device.CUDA: _SOME_16_BIT}.get(engine.device)


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


def _coerce_enums(obj: Any) -> None:
    """Turn string values of enum-typed fields into the enum, for frozen dataclasses."""
    for field in dataclasses.fields(obj):
        enum_type = _ENUM_FIELDS.get(field.type) if isinstance(field.type, str) else None
        if enum_type is None:
            continue
        value = getattr(obj, field.name)
        if not isinstance(value, enum_type):
            try:
                object.__setattr__(obj, field.name, enum_type(value))
            except ValueError:
                choices = ", ".join(member.value for member in enum_type)
                raise ConfigError(field.name, f"{value!r} is not one of: {choices}") from None


_ENUM_FIELDS: dict[str, type[StrEnum]] = {  # filled below, once every enum is defined
    "AttentionBackendName": AttentionBackendName,
    "DType": DType,
    "Device": Device,
    "KVCacheDType": KVCacheDType,
    "SchedulingPolicy": SchedulingPolicy,
    "SpeculativeMethod": SpeculativeMethod,
    "StateDType": StateDType,
}


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
    # context times its factor: common.hf_config.max_context_len). Larger values are capped.
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
        _coerce_enums(self)
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


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class FailurePolicy(StrEnum):
    RECOMPUTE = "recompute"  # prefill locally on the decode worker; output unchanged
    FAIL = "fail"  # the request fails with a clear error


_ENUM_FIELDS["FailurePolicy"] = FailurePolicy


class ToolCallParser(StrEnum):
    NONE = "none"  # tool_choice "auto" refused: only required or a named function
    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen2.5/3, Hermes)
    LLAMA3_JSON = "llama3_json"  # the answer is {"name": ..., "parameters": ...} (Llama 3.x)
    MISTRAL = "mistral"  # [TOOL_CALLS] then a JSON list, or NAME[ARGS]{...} per call (Mistral)
    GLM45 = "glm45"  # <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>... (GLM-4.5)
    DEEPSEEK_V3 = "deepseek_v3"  # <｜tool▁calls▁begin｜>... (DeepSeek-V3, R1, V3.1)
    MINIMAX_M2 = "minimax_m2"  # <minimax:tool_call><invoke name=...><parameter ...> (MiniMax-M2)
    KIMI_K2 = "kimi_k2"  # <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0... (K2)


_ENUM_FIELDS["ToolCallParser"] = ToolCallParser


class ReasoningParser(StrEnum):
    NONE = "none"  # the text is the content, thinking included
    DEEPSEEK_R1 = "deepseek_r1"  # <think>...</think>, always thinks (DeepSeek-R1, QwQ)
    QWEN3 = "qwen3"  # <think>...</think> where the output or the prompt opens one (Qwen3)


_ENUM_FIELDS["ReasoningParser"] = ReasoningParser


class ScoreMethod(StrEnum):
    EMBEDDING = "embedding"  # the cosine similarity of the two texts' embeddings
    TOKEN_LOGITS = "token_logits"  # one prompt per pair, read off next-token logits


_ENUM_FIELDS["ScoreMethod"] = ScoreMethod

# score_template's default: the two texts one after the other (vLLM's pairing of texts).
DEFAULT_SCORE_TEMPLATE = "{query}{document}"


# Each worker owns PORT_STRIDE consecutive ports from its base port (see ``WorkerPorts``).
PORT_STRIDE = 10


@dataclass(frozen=True, slots=True)
class WorkerPorts:
    """The ports of one worker, all bound to its role's host."""

    grpc: int
    events: int  # ZMQ PUB: KV events
    replay: int  # ZMQ ROUTER: replay of recent event batches
    kv_transfer: int  # the connector's own listener, if it has one
    kv_store: int  # the connector's rendezvous store, if it has one

    @classmethod
    def from_base(cls, base: int) -> WorkerPorts:
        return cls(base, base + 1, base + 2, base + 3, base + 4)


@dataclass(frozen=True, slots=True)
class WorkerRoleConfig:
    """How many workers of one role, where they listen, and their engine differences."""

    replicas: int = 1
    host: str = "127.0.0.1"
    # Base port of replica 0; replica i starts at port + i * PORT_STRIDE.
    port: int = 18100
    # EngineConfig fields that differ for this role (e.g. a larger max_num_seqs on decode).
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    # SIGTERM: stop accepting, let in-flight requests finish for at most this long.
    drain_grace_s: float = 30.0

    def ports(self, index: int) -> WorkerPorts:
        return WorkerPorts.from_base(self.port + index * PORT_STRIDE)


@dataclass(frozen=True, slots=True)
class PrefillRoleConfig(WorkerRoleConfig):
    port: int = 18100


@dataclass(frozen=True, slots=True)
class DecodeRoleConfig(WorkerRoleConfig):
    port: int = 18200


# The connectors kv_transfer implements (kv_transfer.ConnectorName; common cannot import it).
CONNECTORS = ("nixl", "nccl", "shared_storage")


# A decode worker starts a pull only if it can end this long before the prefill worker's
# lease does: the Generate call's transit (the lease is timed on monotonic clocks, from
# the router's send), or, with a router or prefill worker from before, how far two
# hosts' wall clocks may disagree.
CLOCK_SKEW_S = 1.0


@dataclass(frozen=True, slots=True)
class KVTransferSettings:
    connector: str = "nixl"  # nixl | nccl | shared_storage
    lease_s: float = 30.0  # a prefill worker frees un-pulled KV after this long
    failure_policy: FailurePolicy = FailurePolicy.RECOMPUTE
    timeout_s: float = 10.0  # a pull that has not finished by then fails
    shared_dir: str | None = None  # shared_storage: the shared directory
    # shared_storage: bytes the shared directory may hold (all models and workers on it);
    # least recently used blocks are removed past it. 0: no cap (a full disk still frees
    # a tenth). Keep it well above what is in flight: lease_s of peak prefill output.
    shared_max_bytes: int = 0
    # nixl: read lanes (agent + thread each) a large pull is split over; 0: one per core up
    # to 4 on CPU memory, 1 on GPU memory. Lower it where the decode engine needs the cores.
    nixl_read_lanes: int = 0
    # nixl, CPU memory, two lanes or more: pin each lane to its own core. Turn it off where
    # several decode workers share the same cores (or give each worker its own cpuset).
    nixl_pin_lanes: bool = True

    def __post_init__(self) -> None:
        _coerce_enums(self)
        if self.connector not in CONNECTORS:
            raise ConfigError(
                "kv_transfer.connector",
                f"{self.connector!r} is not one of: {', '.join(CONNECTORS)}",
            )
        if self.connector == "shared_storage" and not self.shared_dir:
            raise ConfigError(
                "kv_transfer.shared_dir", "the shared_storage connector needs a directory"
            )
        if self.lease_s <= 0:
            raise ConfigError("kv_transfer.lease_s", f"must be > 0, got {self.lease_s}")
        if self.shared_max_bytes < 0:
            raise ConfigError(
                "kv_transfer.shared_max_bytes",
                f"must be >= 0 (0: no cap), got {self.shared_max_bytes}",
            )
        if self.nixl_read_lanes < 0:
            raise ConfigError(
                "kv_transfer.nixl_read_lanes",
                f"must be >= 0 (0: automatic), got {self.nixl_read_lanes}",
            )
        if self.timeout_s <= 0:
            raise ConfigError("kv_transfer.timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.timeout_s + CLOCK_SKEW_S >= self.lease_s:
            raise ConfigError(
                "kv_transfer.timeout_s",
                f"must be below lease_s={self.lease_s} by more than {CLOCK_SKEW_S:g} s (the "
                "allowance for a call's transit): a pull may not outlive its lease",
            )


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    # Size of each worker's CPU tier (pinned memory on CUDA); 0 disables it. A role's
    # engine.cpu_offload_bytes overrides it (the shared engine section may not set it).
    cpu_bytes: int = 0

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0:
            raise ConfigError("offload.cpu_bytes", f"must be >= 0, got {self.cpu_bytes}")


def valid_api_key(key: str) -> bool:
    """Whether ``key`` is one ``PDSERVE_API_KEYS`` can carry (its keys are separated by
    commas or whitespace; a header carries printable ASCII alone)."""
    return bool(key) and key.isascii() and key.isprintable() and not ("," in key or " " in key)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer keys accepted on /v1 and /tokenize; empty: no authentication.
    api_keys: list[str] = dataclasses.field(default_factory=list)
    # The name clients pass as "model"; empty: the checkpoint directory's name ("demo" for
    # the built-in model).
    served_model_name: str = ""
    # Prompts whose part not cached on the chosen decode worker is shorter than this are
    # prefilled there (no transfer); longer ones go to a prefill worker.
    min_disagg_tokens: int = 256
    # Placement weights. A CPU-tier hit saves this fraction of a GPU hit's prefill work.
    cpu_hit_credit: float = 0.5
    # Assumed prefill speed of a worker that has not reported one yet (tokens/s).
    default_prefill_tokens_per_s: float = 5000.0
    # Use each prefill worker's own measured speed (heterogeneous hardware). Off: the
    # median over the prefill workers, since on identical hardware differences between
    # measurements are noise (a worker that only saw short prompts looks slow).
    per_worker_prefill_rate: bool = False
    # Prefill cost also charges this much per token a worker would recompute that another
    # already caches: work wasted system-wide, which delays everyone's later requests.
    prefill_recompute_penalty: float = 4.0
    # Decode score = load - decode_prefix_weight * (cached fraction of the prompt).
    decode_prefix_weight: float = 0.5
    # Both prefix terms above are divided by the matched prefix's uses, decayed over
    # this many seconds: a prefix many requests share is worth recomputing elsewhere
    # (router/prefix_demand.py). 0: never divided.
    prefix_reuse_window_s: float = 30.0
    # Sequences in flight through this router (a request runs len(prompts) * n of them)
    # beyond which new requests get 429 (Retry-After); a single request asking for more
    # gets 400. Per router: N routers in front of one pool admit up to N times this.
    max_inflight_sequences: int = 1024
    # A request body larger than this is a 413, refused before the router reads it.
    # 32 MiB holds a 1M-token prompt's text (~4 characters a token) even if every
    # character came JSON-escaped (\uXXXX, 6 bytes).
    max_request_bytes: int = 32 << 20
    # A vision-language model's images per request (OpenAI's image_url content parts),
    # each counted as a run of placeholder tokens in the prompt; together they fit
    # max_request_bytes, fetched ones included.
    max_images_per_request: int = 8
    # Hosts whose http(s) image URLs the router fetches, by exact name
    # ("images.example.com"); empty: images come inline only (data: URLs). A server that
    # fetches what clients name can be pointed at its own network: list only hosts that
    # serve images you mean to be read. Redirects are not followed.
    allowed_media_domains: list[str] = dataclasses.field(default_factory=list)
    media_fetch_timeout_s: float = 10.0  # one whole fetch
    # Web pages whose scripts may call the API from a browser (CORS), by origin
    # ("https://chat.example.com"), or "*" for any (vLLM's default); empty: no CORS
    # headers, so browsers keep other origins' pages from reading the answers.
    allowed_origins: list[str] = dataclasses.field(default_factory=list)
    prefill_timeout_s: float = 120.0  # one prefill try
    # A sequence's whole journey, from admission: waiting for room on a decode worker,
    # its prefill tries and its decode (a 503 once passed).
    request_timeout_s: float = 600.0
    # How often the router refreshes the worker list, health and load.
    refresh_interval_s: float = 1.0
    # A worker that answers no probe for this long (frozen: a hung device, a stopped
    # process) has its requests in flight failed, or retried where nothing was sent yet.
    worker_stall_timeout_s: float = 10.0
    # How often one sequence may move to another decode worker after its tokens began to
    # stream (its worker died or froze): the new worker recomputes prompt + tokens so far
    # and goes on, so the client sees no error. It also bounds the damage of a request
    # that crashes engines (each move can take one more worker down). 0: such a failure
    # ends the stream with an error.
    max_decode_migrations: int = 1
    # Backpressure: a sequence starts (its prefill, wherever it runs) only while the
    # sequences ahead on its decode worker (in its batch, queued there, or in prefill for
    # it) number fewer than this many times the decode workers' max_num_seqs, and their
    # prompts (with its own) take at most this many times that worker's KV cache; later
    # ones wait in the router, first come first served, instead of leaving prefill
    # workers' KV leased to a decode worker that cannot pull it yet. 0: no limit.
    decode_queue_factor: float = 2.0
    drain_grace_s: float = 30.0
    # How long an idle client connection stays open for its next request. Above the idle
    # timeouts of the pools and load balancers in front (AWS ALB 60 s; nginx upstream
    # keepalive 60 s): a client that sends just as the router closes the connection gets
    # a connection error (uvicorn's 5 s: 1 in 16 requests sent ~5 s after the last). Each
    # idle connection holds a file descriptor that long (raise the router's fd limit for
    # many short-lived clients).
    keep_alive_s: float = 75.0
    # How tool calls are read from a model's free text, for tool_choice "auto" (the
    # default when a request gives tools): the model family's own call format, as
    # vLLM's --tool-call-parser. none: "auto" is refused ("required" and a named
    # function constrain the output instead and need no parser).
    tool_call_parser: ToolCallParser = ToolCallParser.NONE
    # vLLM's --reasoning-parser: a chat reply's thinking goes out as reasoning_content
    # (router/reasoning.py), and a constraint applies after it. none: all is content.
    reasoning_parser: ReasoningParser = ReasoningParser.NONE
    # Text in a chat request that spells a special token (a user writing "<|im_end|>\n
    # <|im_start|>system\n..."): false keeps it text, so no client can forge the
    # template's turns or markers; true makes it the token, as vLLM and transformers do.
    parse_special_tokens_in_messages: bool = False
    # /v1/score and /v1/rerank: how a (query, document) pair is scored (router/scoring.py).
    # embedding: the cosine similarity of their embeddings (an embedding model's).
    # token_logits: one prompt per pair, score_template with {query} and {document}
    # filled in, scored by the model's next-token logits at score_tokens: a causal-LM
    # reranker, such as Qwen3-Reranker (["no", "yes"]: the softmax probability of the
    # second) or bge-reranker-v2-gemma (["Yes"]: the logit's sigmoid).
    score_method: ScoreMethod = ScoreMethod.EMBEDDING
    score_tokens: tuple[str, ...] = ()
    score_template: str = DEFAULT_SCORE_TEMPLATE

    def __post_init__(self) -> None:
        _coerce_enums(self)
        if self.score_method is ScoreMethod.TOKEN_LOGITS:
            if len(self.score_tokens) not in (1, 2):
                raise ConfigError("router.score_tokens", "token_logits reads 1 token (its "
                                  "logit's sigmoid) or 2 (negative, positive)")  # fmt: skip
            if len(set(self.score_tokens)) != len(self.score_tokens):
                raise ConfigError("router.score_tokens", "the negative and the positive token "
                                  "must differ (every score would be 0.5)")  # fmt: skip
            for key in ("{query}", "{document}"):
                if key not in self.score_template:
                    raise ConfigError("router.score_template", f"must contain {key}")
        elif self.score_tokens or self.score_template != DEFAULT_SCORE_TEMPLATE:
            raise ConfigError("router.score_method", "score_tokens and score_template apply "
                              "to token_logits only; set score_method: token_logits")  # fmt: skip
        if not 0.0 <= self.cpu_hit_credit <= 1.0:
            raise ConfigError("router.cpu_hit_credit", "must be in [0, 1]")
        if self.min_disagg_tokens < 0:
            raise ConfigError("router.min_disagg_tokens", "must be >= 0")
        if self.max_inflight_sequences < 1:
            raise ConfigError("router.max_inflight_sequences", "must be >= 1")
        if self.max_request_bytes < 1:
            raise ConfigError("router.max_request_bytes", "must be >= 1")
        if self.max_images_per_request < 0:
            raise ConfigError("router.max_images_per_request", "must be >= 0")
        if self.media_fetch_timeout_s <= 0:
            raise ConfigError("router.media_fetch_timeout_s", "must be > 0")
        if not all(map(valid_api_key, self.api_keys)):  # (pdserve up passes them on so)
            raise ConfigError("router.api_keys", "each key must be printable ASCII without "
                              "spaces or commas")  # fmt: skip
        for domain in self.allowed_media_domains:  # (a URL, port or wildcard never matched)
            if not _HOST_NAME.fullmatch(domain):
                raise ConfigError("router.allowed_media_domains", f"{domain!r} is not a host "
                                  "name (images.example.com: no scheme, port, path or "
                                  "wildcard)")  # fmt: skip
        for origin in self.allowed_origins:
            scheme, _, host = origin.partition("://")
            if origin != "*" and (scheme not in ("http", "https") or not host or "/" in host):
                raise ConfigError("router.allowed_origins", f"{origin!r} is not an origin "
                                  "(scheme://host[:port], no path) or '*'")  # fmt: skip
        if self.max_decode_migrations < 0:
            raise ConfigError("router.max_decode_migrations", "must be >= 0")
        if self.decode_queue_factor < 0:
            raise ConfigError("router.decode_queue_factor", "must be >= 0")
        for key in (
            "default_prefill_tokens_per_s",
            "prefill_timeout_s",
            "request_timeout_s",
            "refresh_interval_s",
            "worker_stall_timeout_s",
            "keep_alive_s",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"router.{key}", "must be > 0")
        if self.drain_grace_s < 0:
            raise ConfigError("router.drain_grace_s", f"must be >= 0, got {self.drain_grace_s}")
        for key in ("prefill_recompute_penalty", "decode_prefix_weight", "prefix_reuse_window_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"router.{key}", f"must be >= 0, got {getattr(self, key)}")
        if not self.host:
            raise ConfigError("router.host", "must not be empty")


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    redis_url: str | None = None  # None: the static list this config implies
    ttl_s: float = 10.0
    heartbeat_s: float = 2.0
    key_prefix: str = "pdserve"

    def __post_init__(self) -> None:
        if not self.ttl_s >= 1:  # (Redis keeps whole milliseconds: 0.0009 s deleted at once)
            raise ConfigError("registry.ttl_s", f"must be at least 1 (seconds), got {self.ttl_s}")
        problem = None if self.redis_url is None else redis_url_problem(self.redis_url)
        if problem is not None:
            raise ConfigError("registry.redis_url", problem)
        if not 0 < self.heartbeat_s <= self.ttl_s / 2:  # one late heartbeat is no expiry
            raise ConfigError("registry.heartbeat_s", "must be > 0 and at most half of "
                                                      f"registry.ttl_s ({self.ttl_s})")  # fmt: skip


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry request traces (``common/tracing.py``): spans exported over OTLP/HTTP
    to ``otlp_traces_endpoint`` (a collector's ``http://host:4318/v1/traces``); None: off.
    ``sample_ratio``: the share of new traces recorded (a client's sampled trace context
    decides for its own requests)."""

    otlp_traces_endpoint: str | None = None
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                "tracing.otlp_traces_endpoint",
                f"{endpoint!r} is not an http(s) URL (traces are sent as OTLP over HTTP: "
                "a collector's http://host:4318/v1/traces)",
            )
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError("tracing.sample_ratio", f"must be in [0, 1], got {self.sample_ratio}")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The router's live plan (``router/live_plan.py``): every ``interval_s`` it sizes what
    it served over the last ``window_s`` (``planner/sizing.py``) against a ``pdserve plan
    profile`` file and the targets (means, or the percentiles ``ttft_percentile`` and
    ``itl_percentile`` name), and shows the layout in its metrics
    (``pdserve:planned_replicas``): for an autoscaler to follow, or an operator to read.
    With ``autoscale``, ``pdserve up`` follows it itself: it starts workers and drains them
    between the minima here and each role's ``replicas`` (then the most it runs); a lower
    plan must hold for ``scale_in_delay_s`` before a worker is drained. ``correct``: scale
    the profile by how much slower or faster the workers were seen (the window's mean TTFT
    and ITL against the profile's prediction for the layout that served it)."""

    profile: str | None = None  # None: no live plan
    ttft_ms: float = 1000.0
    itl_ms: float = 50.0
    ttft_percentile: float | None = None  # None: ttft_ms is a mean; 90: a p90
    itl_percentile: float | None = None
    max_utilization: float = 0.85
    window_s: float = 60.0
    interval_s: float = 10.0
    correct: bool = True
    autoscale: bool = False
    min_prefill_replicas: int = 0
    min_decode_replicas: int = 1
    scale_in_delay_s: float = 120.0

    def __post_init__(self) -> None:
        for key in ("ttft_ms", "itl_ms", "window_s", "interval_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"planner.{key}", f"must be > 0, got {getattr(self, key)}")
        for key in ("ttft_percentile", "itl_percentile"):
            value = getattr(self, key)
            if value is not None and not 0 < value < 100:
                raise ConfigError(f"planner.{key}", f"must be in (0, 100), got {value}")
        if not 0 < self.max_utilization <= 1:
            raise ConfigError("planner.max_utilization",
                              f"must be in (0, 1], got {self.max_utilization}")  # fmt: skip
        if self.scale_in_delay_s < 0 or self.min_prefill_replicas < 0:
            raise ConfigError("planner", "scale_in_delay_s and min_prefill_replicas must be >= 0")
        if self.min_decode_replicas < 1:
            raise ConfigError("planner.min_decode_replicas", "at least one decode worker runs")
        if self.autoscale and self.profile is None:
            raise ConfigError("planner.autoscale", "needs planner.profile: the plan it follows "
                              "is sized from a profile (`pdserve plan profile`)")  # fmt: skip


# What a LoRA adapter may be called: it is the "model" clients pass and a path segment in
# the containers (/adapters/<name>).
_LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


LORA_NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def valid_lora_name(name: str) -> bool:
    return bool(_LORA_NAME.match(name))


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """LoRA adapters every worker loads at start and keeps resident (engine/models/lora.py),
    and whether more may be loaded and unloaded while serving.

    A client picks one by passing its name as ``model``; the base model stays served under
    its own name. Prefill and decode workers load the same adapters (a request's KV is
    computed with its adapter on one and continued with it on the other)."""

    # name -> a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    # The router's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's API),
    # and the workers' LoadLoraAdapter / UnloadLoraAdapter RPCs. Off by default: a load
    # names a directory the workers read, so it is for operators, not for every client.
    runtime_loading: bool = False
    max_adapters: int = 16  # loaded at once per worker, those of ``adapters`` included
    # An unload first waits this long at most for the adapter's requests in flight
    # through the router to finish (router/lora_adapters.py says why).
    unload_grace_s: float = 30.0

    def __post_init__(self) -> None:
        for name, path in self.adapters.items():
            if not valid_lora_name(name):
                raise ConfigError(f"lora.adapters.{name}", f"a name is {LORA_NAME_RULE}")
            if not path:
                raise ConfigError(f"lora.adapters.{name}", "needs the adapter's directory")
        if self.unload_grace_s < 0:
            raise ConfigError("lora.unload_grace_s", f"must be >= 0, got {self.unload_grace_s}")
        if self.max_adapters < max(1, len(self.adapters)):
            raise ConfigError(
                "lora.max_adapters",
                f"must be >= 1 and >= the {len(self.adapters)} of lora.adapters, "
                f"got {self.max_adapters}",
            )


@dataclass(frozen=True, slots=True)
class PdserveConfig:
    """One deployment: the model, the engine, the xPyD layout and the services around it."""

    model: str | None = None  # a local checkpoint; None: the built-in demo model
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    prefill: PrefillRoleConfig = dataclasses.field(default_factory=PrefillRoleConfig)
    decode: DecodeRoleConfig = dataclasses.field(default_factory=DecodeRoleConfig)
    kv_transfer: KVTransferSettings = dataclasses.field(default_factory=KVTransferSettings)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    registry: RegistryConfig = dataclasses.field(default_factory=RegistryConfig)
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    tracing: TracingConfig = dataclasses.field(default_factory=TracingConfig)
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        served = self.router.served_model_name
        if served and served in self.lora.adapters:
            raise ConfigError(
                f"lora.adapters.{served}", "is also router.served_model_name: names must differ"
            )
        for role in Role:
            section = self.role(role)
            if section.replicas < 0:
                raise ConfigError(f"{role}.replicas", f"must be >= 0, got {section.replicas}")
            if section.drain_grace_s < 0:
                raise ConfigError(
                    f"{role}.drain_grace_s", f"must be >= 0, got {section.drain_grace_s}"
                )
            try:
                self.engine_for(role)
            except ConfigError as exc:
                message = str(exc).split(": ", 1)[-1]
                raise ConfigError(f"{role}.engine.{exc.key.split('.')[-1]}", message) from None
        addresses = self._host_addresses()
        if self.engine.cpu_offload_bytes:  # (was silently replaced by offload.cpu_bytes)
            raise ConfigError("engine.cpu_offload_bytes", "a deployment's CPU tier is "
                              "offload.cpu_bytes (a role's engine.cpu_offload_bytes overrides "
                              "it for that role)")  # fmt: skip
        if self.decode.replicas < 1:
            raise ConfigError("decode.replicas", "at least one decode worker is needed")
        if self.engine_for(Role.PREFILL).block_size != self.engine_for(Role.DECODE).block_size:
            raise ConfigError(
                self._shared_key("block_size"),
                "prefill and decode must use the same block size: KV blocks move between them "
                "block for block, and the router hashes a prompt's blocks once for both",
            )
        tp_sizes = {role: self.engine_for(role).tensor_parallel_size for role in Role}
        if tp_sizes[Role.PREFILL] != tp_sizes[Role.DECODE]:
            raise ConfigError(
                self._shared_key("tensor_parallel_size"),
                f"prefill uses {tp_sizes[Role.PREFILL]} tensor-parallel ranks and decode "
                f"{tp_sizes[Role.DECODE]}: KV moves rank to rank (each holds its KV heads), so "
                "both roles need the same tensor_parallel_size",
            )
        kv_dtypes = {role: self.engine_for(role).kv_cache_dtype.storage_name for role in Role}
        if kv_dtypes[Role.PREFILL] != kv_dtypes[Role.DECODE]:
            names = {role: self.engine_for(role).kv_cache_dtype.value for role in Role}
            raise ConfigError(
                self._shared_key("kv_cache_dtype"),
                f"prefill stores KV as {names[Role.PREFILL]} and decode as "
                f"{names[Role.DECODE]}: KV blocks move between them byte for byte, so both "
                "roles need the same kv_cache_dtype",
            )
        self._check_compute_dtypes()
        # Settings both roles must share, and why.
        for key, why in (
            ("scheduling_policy", "the router takes a request's priority only when both "
                                  "roles honour it"),
            ("linear_state_dtype", "a hybrid model's states move between them byte for "
                                   "byte"),
            ("speculative_method", "with mtp or eagle3 the KV cache holds the drafting "
                                   "layer's KV too, which moves with the prompt's blocks, "
                                   "and a prefill worker's first drafts go with its token"),
        ):  # fmt: skip
            values = {role: getattr(self.engine_for(role), key) for role in Role}
            if values[Role.PREFILL] is not values[Role.DECODE]:
                raise ConfigError(
                    self._shared_key(key),
                    f"prefill has {key} {values[Role.PREFILL].value} and decode "
                    f"{values[Role.DECODE].value}: {why}, so both roles need the same {key}",
                )
        heads = {role: self.engine_for(role).draft_model for role in Role}
        eagle3 = self.engine_for(Role.DECODE).speculative_method is SpeculativeMethod.EAGLE3
        if eagle3 and heads[Role.PREFILL] != heads[Role.DECODE]:
            raise ConfigError(
                self._shared_key("draft_model"),
                f"prefill drafts with {heads[Role.PREFILL]} and decode with "
                f"{heads[Role.DECODE]}: an EAGLE-3 head's KV moves with the prompt's blocks, "
                "so both roles need the same head",
            )
        for role, least in ((Role.PREFILL, self.planner.min_prefill_replicas),
                            (Role.DECODE, self.planner.min_decode_replicas)):  # fmt: skip
            if self.planner.autoscale and least > self.role(role).replicas:
                raise ConfigError(
                    f"planner.min_{role}_replicas",
                    f"{least} is above {role}.replicas ({self.role(role).replicas}), the most "
                    "workers of the role autoscaling runs",
                )
        self._check_ports(addresses)

    def role(self, role: Role) -> WorkerRoleConfig:
        return self.prefill if role is Role.PREFILL else self.decode

    def _host_addresses(self) -> dict[str, frozenset[IPAddress]]:
        """Each configured host's addresses on this machine (``common/hosts.py``: literals
        need no lookup, a name is looked up once). ``ConfigError`` naming the key of a host
        that has none, or that a worker cannot use."""
        keyed = [("router.host", self.router.host)]
        keyed += [(f"{role}.host", self.role(role).host) for role in Role]
        addresses: dict[str, frozenset[IPAddress]] = {}
        for key, host in keyed:
            if host not in addresses:
                try:
                    addresses[host] = host_addresses(host)
                except HostError as exc:
                    raise ConfigError(key, str(exc)) from None
        for key, host in keyed[1:]:
            _check_worker_host(key, host, addresses[host])
        return addresses

    def _check_compute_dtypes(self) -> None:
        """The roles compute in one dtype. With ``kv_cache_dtype`` auto the KV cache holds
        it and blocks move between the roles byte for byte: a ``dtype`` or ``device``
        override that made them differ failed every pull at the handshake. With an fp8
        cache the blocks are rounded from it: a float32 prefill's blocks gave a bfloat16
        decode worker other tokens than it computes itself (a disaggregated reply was no
        colocated one), and shared storage keeps such blocks apart by the dtype that
        computed them, where the decode workers never found the prefill workers'. Refused
        here, where the key can be named. On CUDA auto is a 16-bit dtype (which one: the
        checkpoint's), on CPU float32; on an auto device, unknown."""
        engines = {role: self.engine_for(role) for role in Role}
        prefill, decode = (_compute_dtype(engines[role]) for role in (Role.PREFILL, Role.DECODE))
        dtype_differs = engines[Role.PREFILL].dtype != engines[Role.DECODE].dtype
        if (prefill is None) != (decode is None) and (
            dtype_differs or "float32" in (prefill, decode)
        ):
            # One role's dtype (or a CPU device) set, the other's auto on an auto device:
            # float32 on a CPU, 16-bit on a GPU; either way not what the other says on one
            # of them. Passed, a decode dtype of bfloat16 alone recomputed every prompt, as
            # did a prefill device of cpu beside a decode worker's GPU.
            unknown = Role.PREFILL if prefill is None else Role.DECODE
            raise ConfigError(
                self._shared_key("dtype" if dtype_differs else "device"),
                f"{unknown}'s dtype is auto on an auto device (float32 on a CPU, 16-bit on a "
                f"GPU) and the other role computes in {prefill or decode}: decode continues "
                "from prefill's KV blocks, so set the same dtype (or device) on both roles",
            )
        if prefill is None or decode is None or prefill == decode:
            return
        if _SOME_16_BIT in (prefill, decode) and "float32" not in (prefill, decode):
            return  # (auto on CUDA may be the other's 16-bit dtype)
        differs = "dtype" if dtype_differs else "device"
        raise ConfigError(
            self._shared_key(differs),
            f"prefill computes in {prefill} and decode in {decode}: decode continues from "
            "prefill's KV blocks (moved byte for byte, or rounded to the fp8 cache from "
            "prefill's dtype), so both roles need one dtype (set the same dtype and device)",
        )

    def _shared_key(self, name: str) -> str:
        """The key to blame for a setting both roles must share and do not: the role
        section that overrides it (decode's if both do), as the operator wrote it."""
        for role in (Role.DECODE, Role.PREFILL):
            if name in self.role(role).engine:
                return f"{role.value}.engine.{name}"
        return f"decode.engine.{name}"

    def engine_for(self, role: Role) -> EngineConfig:
        overrides = {"cpu_offload_bytes": self.offload.cpu_bytes, **self.role(role).engine}
        return self.engine.replace(**overrides)

    def bound_ports(self) -> list[tuple[str, int, str]]:
        """Each (host, port, owner) the layout binds: the router's port, then every
        worker's ``WorkerPorts``."""
        bound = [(self.router.host, self.router.port, "router.port")]
        for role in Role:
            section = self.role(role)
            for index in range(section.replicas):
                owner = f"{role}.port (replica {index})"
                ports = dataclasses.astuple(section.ports(index))
                bound += [(section.host, port, owner) for port in ports]
        return bound

    def _check_ports(self, addresses: dict[str, frozenset[IPAddress]]) -> None:
        """Every port the layout binds on one machine is distinct where the hosts' addresses
        overlap (``addresses_overlap``: ``localhost`` is 127.0.0.1, a wildcard is every
        address), given each host's ``addresses``."""
        owners: dict[int, list[tuple[str, str]]] = {}
        for host, port, owner in self.bound_ports():
            if not 0 < port < 65536:
                raise ConfigError(owner, f"port {port} is outside 1-65535")
            for other_host, other in owners.setdefault(port, []):
                if other != owner and addresses_overlap(addresses[host], addresses[other_host]):
                    where = "" if other_host == host else f" on {other_host}"
                    raise ConfigError(owner, f"port {port} on {host} is also used by {other}"
                                      f"{where}")  # fmt: skip
            owners[port].append((host, owner))


def _check_worker_host(key: str, host: str, addresses: frozenset[IPAddress]) -> None:
    """A worker's host is both where it listens and the address it registers: no wildcard
    (0.0.0.0, ::, or a name for one); and no IPv6 literal yet."""
    if any(address.is_unspecified for address in addresses):
        raise ConfigError(
            key,
            f"{host} cannot be reached: a worker's host is both where it listens and the "
            "address it registers for the router and its peers; give this machine's address "
            "(the pod IP, the compose service name)",
        )
    literal = ip_literal(host)
    if literal is not None and literal.version == 6:
        raise ConfigError(
            key,
            f"{host}: IPv6 worker addresses are not supported yet (the ZMQ sockets, the NCCL "
            "store and UCX are set up for IPv4); give an IPv4 address or a name",
        )
