from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words_token_ids", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    structured_output: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec", "reasoning_start", "reasoning_end", "reasoning_optional", "reasoning_skip")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_FIELD_NUMBER: _ClassVar[int]
    REASONING_OPTIONAL_FIELD_NUMBER: _ClassVar[int]
    REASONING_SKIP_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    reasoning_start: str
    reasoning_end: str
    reasoning_optional: bool
    reasoning_skip: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., reasoning_start: _Optional[str] = ..., reasoning_end: _Optional[str] = ..., reasoning_optional: _Optional[bool] = ..., reasoning_skip: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("engine_id", "endpoint", "connector", "block_ids", "num_tokens", "lease_id", "block_size", "block_hashes", "lease_expires_at", "state_block_ids", "tp_size", "model_namespace", "lease_ttl_s", "lease_left_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    endpoint: str
    connector: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_id: str
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_expires_at: float
    state_block_ids: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    model_namespace: str
    lease_ttl_s: float
    lease_left_s: float
    def __init__(self, engine_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., connector: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_expires_at: _Optional[float] = ..., state_block_ids: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., model_namespace: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., lease_left_s: _Optional[float] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "transfer_ms", "decode_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    decode_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt", "lora_name", "priority", "images", "lora_fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    lora_name: str
    priority: int
    images: _containers.RepeatedCompositeFieldContainer[Image]
    lora_fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., priority: _Optional[int] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., lora_fingerprint: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "kv", "finish_reason", "num_cached_tokens", "timings", "prompt_logprobs", "draft_token_ids")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: TokenLogprobs
    kv: KVHandle
    finish_reason: str
    num_cached_tokens: int
    timings: StageTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "cache_salt", "lora_name", "priority", "normalize", "logit_token_ids", "lora_fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    lora_name: str
    priority: int
    normalize: bool
    logit_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., priority: _Optional[int] = ..., normalize: _Optional[bool] = ..., logit_token_ids: _Optional[_Iterable[int]] = ..., lora_fingerprint: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embedding", "num_cached_tokens", "timings")
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    embedding: bytes
    num_cached_tokens: int
    timings: StageTimings
    def __init__(self, embedding: _Optional[bytes] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "kv", "cache_salt", "lora_name", "priority", "draft_token_ids", "images", "lora_fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv: KVHandle
    cache_salt: str
    lora_name: str
    priority: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    lora_fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KVHandle, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., priority: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., lora_fingerprint: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "usage", "timings", "num_blocks_pulled", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    usage: Usage
    timings: StageTimings
    num_blocks_pulled: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., num_blocks_pulled: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("lease_id", "request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TransferMetadataRequest(_message.Message):
    __slots__ = ("tp_rank",)
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    def __init__(self, tp_rank: _Optional[int] = ...) -> None: ...

class TransferMetadataResponse(_message.Message):
    __slots__ = ("connector", "metadata")
    CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    connector: str
    metadata: bytes
    def __init__(self, connector: _Optional[str] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("engine_id", "role", "queued_prefill_tokens", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_free", "live_leases", "leases_expired", "leases_released", "prefill_tokens_per_s", "prefix_query_tokens", "prefix_hit_tokens", "blocks_pulled", "blocks_reused_locally", "transfer_failures", "requests_finished", "mean_timings", "draining", "kv_blocks_total", "cpu_blocks_total", "cpu_blocks_used", "offloaded_blocks", "offloaded_bytes", "cpu_hit_blocks", "cpu_load_ms_total", "num_preemptions", "draft_tokens", "accepted_draft_tokens", "lora_adapters", "expert_rebalances", "expert_moved_slots", "expert_imbalance", "images_encoded", "engine_steps", "engine_busy_seconds", "kv_blocks_quarantined")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REUSED_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    MEAN_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_LOAD_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MOVED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: str
    queued_prefill_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    live_leases: int
    leases_expired: int
    leases_released: int
    prefill_tokens_per_s: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    blocks_pulled: int
    blocks_reused_locally: int
    transfer_failures: int
    requests_finished: int
    mean_timings: StageTimings
    draining: bool
    kv_blocks_total: int
    cpu_blocks_total: int
    cpu_blocks_used: int
    offloaded_blocks: int
    offloaded_bytes: int
    cpu_hit_blocks: int
    cpu_load_ms_total: float
    num_preemptions: int
    draft_tokens: int
    accepted_draft_tokens: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    expert_rebalances: int
    expert_moved_slots: int
    expert_imbalance: float
    images_encoded: int
    engine_steps: int
    engine_busy_seconds: float
    kv_blocks_quarantined: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[str] = ..., queued_prefill_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., live_leases: _Optional[int] = ..., leases_expired: _Optional[int] = ..., leases_released: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., blocks_pulled: _Optional[int] = ..., blocks_reused_locally: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., requests_finished: _Optional[int] = ..., mean_timings: _Optional[_Union[StageTimings, _Mapping]] = ..., draining: _Optional[bool] = ..., kv_blocks_total: _Optional[int] = ..., cpu_blocks_total: _Optional[int] = ..., cpu_blocks_used: _Optional[int] = ..., offloaded_blocks: _Optional[int] = ..., offloaded_bytes: _Optional[int] = ..., cpu_hit_blocks: _Optional[int] = ..., cpu_load_ms_total: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., expert_rebalances: _Optional[int] = ..., expert_moved_slots: _Optional[int] = ..., expert_imbalance: _Optional[float] = ..., images_encoded: _Optional[int] = ..., engine_steps: _Optional[int] = ..., engine_busy_seconds: _Optional[float] = ..., kv_blocks_quarantined: _Optional[int] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter", "already_loaded")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapterInfo
    already_loaded: bool
    def __init__(self, adapter: _Optional[_Union[LoraAdapterInfo, _Mapping]] = ..., already_loaded: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...
