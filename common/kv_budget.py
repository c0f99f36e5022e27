"""Does each role's KV cache fit? Checked from the model's config.json, without torch,
before any process starts.

A worker sizes its pool when it starts (``engine.model_runner``): ``engine.num_blocks`` if
set, else ``kv_cache_bytes // bytes_per_block`` on CPU, else what ``gpu_memory_utilization``
leaves free on CUDA; a pool smaller than one request of ``max_model_len`` is refused. This
module does the same arithmetic up front, so ``pdserve config check`` and every entry point
reject an impossible layout with the key to change, instead of a worker dying after it
loaded the weights.

What can be known here depends on the device. ``device: cpu`` is fully checked. On CUDA
the pool size depends on free GPU memory, so only an explicit ``num_blocks`` is checked.
``device: auto`` is checked for what holds on any device; the CPU-only arithmetic becomes
a warning, since this machine need not be the one that serves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import PdserveConfig, Role
from common.config_base import ConfigError
from common.engine_config import (
    Device,
    DType,
    EngineConfig,
    SpeculativeMethod,
    max_model_len_problem,
)
from common.hf_config import (
    MAMBA2_MODEL_TYPES,
    draft_vocab_problem,
    eagle3_kv_problem,
    eagle3_layer_config,
    kv_cache_heads,
    layer_types,
    linear_heads,
    linear_state_bytes,
    max_context_len,
    num_mtp_layers,
    text_config,
)
from common.intmath import cdiv
from common.model_info import model_dir_of
from common.tensor_parallel import (
    expert_split_problem,
    linear_split_problem,
    local_kv_heads,
    mamba_split_problem,
    split_problem,
)

_DTYPE_BYTES = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a checkpoint's config.json that size its KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context_len: int  # hf_config.max_context_len
    num_q_heads: int = 1
    # The MLP widths tensor parallelism splits, by config key (engine.parallel.shard_spec).
    split_widths: tuple[tuple[str, int], ...] = ()
    # Multi-token-prediction layers stored after the others (DeepSeek-V3, GLM-4.5): one
    # more KV cache layer when the engine drafts with them (speculative_method: mtp).
    num_mtp_layers: int = 0
    num_experts: int = 0  # routed experts (MoE models)
    vocab_size: int = 0
    # A hybrid model's linear-attention layers (no KV cache): their count, and
    # ``text_config``'s keys, which size one request's states in them (``rank_state_bytes``).
    num_linear_layers: int = 0
    num_mlp_layers: int = 0  # Nemotron-H's layers that are an MLP (or experts) alone: no KV
    text_cfg: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape | None:
        """None when ``model_dir`` holds no config.json (e.g. it exists only where the
        deployment runs)."""
        path = model_dir / "config.json"
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise TypeError(f"it holds a {type(raw).__name__}, not a mapping")
            cfg = text_config(raw)
            num_kv_heads, head_dim = kv_cache_heads(cfg)
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                max_context_len=max_context_len(cfg),
                num_q_heads=int(cfg["num_attention_heads"]),
                split_widths=_split_widths(cfg),
                num_mtp_layers=num_mtp_layers(cfg),
                num_experts=int(_num_experts(cfg) or 0),
                vocab_size=int(cfg.get("vocab_size", 0)),
                num_linear_layers=(layer_types(cfg) or []).count("linear_attention"),
                num_mlp_layers=sum(t in ("mlp", "moe") for t in layer_types(cfg) or []),
                text_cfg=cfg,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("model", f"{path} is not a usable checkpoint config: {exc}") from None

    def bytes_per_block(
        self, block_size: int, dtype_bytes: int, tp_size: int = 1, draft_layer: bool = False
    ) -> int:
        """K and V of ``block_size`` tokens in every cache layer (one block id, all layers;
        with ``draft_layer`` the MTP layer's or EAGLE-3 head's too, of the same shape), on
        one of ``tp_size`` tensor-parallel ranks (each holds its KV heads)."""
        num_kv_heads = local_kv_heads(self.num_kv_heads, tp_size)
        num_layers = self.num_layers - self.num_linear_layers - self.num_mlp_layers
        num_layers += int(draft_layer)
        return num_layers * 2 * block_size * num_kv_heads * self.head_dim * dtype_bytes

    def state_blocks(
        self, bytes_per_block: int, num_slots: int, tp_size: int = 1, itemsize: int = 4
    ) -> int:
        """KV blocks a hybrid model's engine sets aside for its linear-attention states:
        ``num_slots`` slots (``max_num_seqs``, and ``num_speculative_tokens`` per group of
        draft slots: ``EngineConfig.num_draft_state_groups``), each
        of whole blocks of one rank's (which holds its heads' share of the states:
        ``engine.model_shard``)."""
        return num_slots * cdiv(self.rank_state_bytes(tp_size, itemsize), bytes_per_block)

    def rank_state_bytes(self, tp_size: int = 1, itemsize: int = 4) -> int:
        """Bytes of one request's linear-attention states on one of ``tp_size`` ranks,
        kept in elements of ``itemsize`` bytes (``engine.linear_state_dtype``;
        ``engine/linear_state.py``); 0 for a model without such layers."""
        if not self.num_linear_layers:
            return 0
        return linear_state_bytes(self.text_cfg, tp_size) // 4 * itemsize

    def linear_split_problem(self, tp_size: int) -> str | None:
        """Why the linear-attention layers do not split over ``tp_size`` ranks, or None."""
        if not self.num_linear_layers or tp_size == 1:
            return None
        if self.text_cfg.get("model_type") in MAMBA2_MODEL_TYPES:
            return mamba_split_problem(*linear_heads(self.text_cfg), tp_size)
        return linear_split_problem(*linear_heads(self.text_cfg), tp_size)


def _num_experts(cfg: dict) -> int | None:
    return cfg.get("num_local_experts", cfg.get("num_experts", cfg.get("n_routed_experts")))


def _split_widths(cfg: dict) -> tuple[tuple[str, int], ...]:
    """The MLP widths a tensor-parallel split cuts (as ``engine.parallel.shard_spec``
    reads them): dense layers' (all but the MoE models whose every layer is sparse)
    and the experts' (and the shared expert's)."""
    widths = []
    experts = _num_experts(cfg)
    all_sparse = (
        experts and not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1
        and not cfg.get("first_k_dense_replace")
    )  # fmt: skip
    if not all_sparse:
        widths.append(("intermediate_size", int(cfg["intermediate_size"])))
    if experts:
        key = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
        widths.append(("moe_intermediate_size", int(cfg[key])))
        # Qwen2-MoE's shared expert has its own width; DeepSeek's shared experts are one
        # MLP of n_shared_experts expert widths.
        shared = cfg.get("shared_expert_intermediate_size") or int(cfg[key]) * int(
            cfg.get("n_shared_experts") or 0
        )
        if shared:
            widths.append(("shared_expert_intermediate_size", shared))
    return tuple(widths)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """One role's KV pool as far as it can be known before start."""

    role: Role
    block_size: int
    max_model_len: int
    min_blocks: int  # one request of max_model_len
    # Bytes per block at the dtype the worker will use; None when that depends on the
    # device (auto dtype on an auto device); ``cpu_bytes_per_block`` is the CPU figure.
    bytes_per_block: int | None
    cpu_bytes_per_block: int
    # The pool size, when known before start (explicit, or from kv_cache_bytes on CPU).
    num_blocks: int | None
    warnings: tuple[str, ...] = ()
    # (key, message) for what its pool cannot hold if it runs on a CPU (its device is
    # auto): warnings above; errors where the host surely has no CUDA (``pdserve up``).
    cpu_problems: tuple[tuple[str, str], ...] = ()
    # A hybrid model's state slots (``max_num_seqs`` + draft groups x drafts) and
    # one slot's bytes on each rank, in ``engine.linear_state_dtype``; 0 for other models.
    state_slots: int = 0
    state_bytes_per_slot: int = 0


def kv_budgets(config: PdserveConfig) -> list[KVBudget] | None:
    """Each role's budget (roles with replicas only), or None when the model's config.json
    is not on this machine. Raises ``ConfigError`` naming the key for a pool that cannot
    hold one request, or that exceeds the CPU KV budget it was given."""
    shape = ModelShape.read(model_dir_of(config))
    if shape is None:
        return None
    # Every role, even one with no replicas: with a Redis registry it may still join.
    return [_budget(config, role, shape) for role in Role]


def check_kv_fit(config: PdserveConfig) -> None:
    kv_budgets(config)


def _key(config: PdserveConfig, role: Role, name: str) -> str:
    """The key that set ``name`` for ``role``: its override if it has one."""
    if name in config.role(role).engine:
        return f"{role}.engine.{name}"
    return "offload.cpu_bytes" if name == "cpu_offload_bytes" else f"engine.{name}"


_MAX_BLOCK_TABLE_BYTES = 64 << 30  # (Llama 4 Scout's 10M context x 2048 sequences: 5 GiB)


def _budget(config: PdserveConfig, role: Role, shape: ModelShape) -> KVBudget:
    engine = config.engine_for(role)
    tp_size = engine.tensor_parallel_size
    widths = dict(shape.split_widths)
    if engine.expert_parallel and shape.num_experts:  # whole experts: their count divides
        del widths["moe_intermediate_size"]
        redundant = engine.num_redundant_experts
        problem = expert_split_problem(shape.num_experts, redundant, tp_size)
        if problem is not None:
            key = "num_redundant_experts" if redundant else "expert_parallel"
            raise ConfigError(_key(config, role, key), problem)
    hybrid = engine.hybrid_problem() if shape.num_linear_layers else None
    if hybrid is not None:
        raise ConfigError(_key(config, role, hybrid[0]), f"{model_dir_of(config)}: {hybrid[1]}")
    problem = split_problem(shape.num_q_heads, shape.num_kv_heads, widths, tp_size)
    if problem is None:
        problem = shape.linear_split_problem(tp_size)
    if problem is not None:
        raise ConfigError(_key(config, role, "tensor_parallel_size"), problem)
    max_model_len = engine.max_model_len or shape.max_context_len
    problem = max_model_len_problem(max_model_len, shape.max_context_len)
    if problem is not None:
        raise ConfigError(_key(config, role, "max_model_len"), problem)
    min_blocks = cdiv(max_model_len, engine.block_size)
    # The block table is allocated whole at start (a row of int32 block ids per sequence):
    # a max_num_seqs of 10^8 passed here and failed the worker's start on a 100 GB alloc.
    table_bytes = 4 * (engine.max_num_seqs + 32) * (min_blocks + 2)
    if table_bytes > _MAX_BLOCK_TABLE_BYTES:
        raise ConfigError(
            _key(config, role, "max_num_seqs"),
            f"{engine.max_num_seqs} sequences of up to {max_model_len} tokens need a "
            f"{table_bytes / 2**30:.1f} GiB block table; lower it (or max_model_len)",
        )
    method = engine.speculative_method
    if method is SpeculativeMethod.MTP and not shape.num_mtp_layers:
        raise ConfigError(
            _key(config, role, "speculative_method"),
            f"mtp needs a multi-token-prediction layer; {model_dir_of(config)} has none "
            "(DeepSeek-V3's and GLM-4.5's checkpoints do: num_nextn_predict_layers)",
        )
    draft = _draft_shape(config, role, shape)

    def block_bytes(element_bytes: int) -> int:
        """Rank 0's bytes of a block: its share of the target's KV, and the draft
        model's whole (it runs on rank 0 alone)."""
        target = shape.bytes_per_block(
            engine.block_size, element_bytes, tp_size, method.reads_target_states
        )
        return target + (draft.bytes_per_block(engine.block_size, element_bytes) if draft else 0)

    cpu_bpb = block_bytes(_dtype_bytes(engine, Device.CPU))
    bpb = None
    known = engine.device is not Device.AUTO or engine.dtype is not DType.AUTO
    if known or engine.kv_cache_dtype.storage_name is not None:
        bpb = block_bytes(_dtype_bytes(engine, engine.device))
    too_small = (
        f"cannot hold one request of max_model_len={max_model_len} ({min_blocks} blocks of "
        f"{engine.block_size} tokens); give the KV cache more memory or lower "
        f"{_key(config, role, 'max_model_len')}"
    )
    if engine.num_blocks is not None and engine.num_blocks < min_blocks:
        message = f"{engine.num_blocks} KV blocks {too_small}"
        raise ConfigError(_key(config, role, "num_blocks"), message)
    num_slots = engine.max_num_seqs + engine.num_draft_state_groups * engine.num_speculative_tokens
    itemsize = engine.linear_state_dtype.itemsize
    state_blocks = shape.state_blocks(cpu_bpb, num_slots, tp_size, itemsize)
    problems = _cpu_problems(config, role, engine, cpu_bpb, min_blocks, too_small, state_blocks)
    if engine.device is Device.CPU and problems:
        raise ConfigError(*problems[0])
    warnings = [f"{key}: on a host without CUDA, {message}" for key, message in problems]
    tier_block_bytes = bpb or cpu_bpb
    snapshot_blocks = shape.state_blocks(tier_block_bytes, 1, tp_size, itemsize)
    if 0 < engine.cpu_offload_bytes < tier_block_bytes:
        no_block = (f"{engine.cpu_offload_bytes} bytes hold no block of {tier_block_bytes} "
                    "bytes")  # fmt: skip
        if bpb is not None:  # the worker would refuse to start
            raise ConfigError(_key(config, role, "cpu_offload_bytes"),
                              f"{no_block} (0: no CPU tier)")  # fmt: skip
        warnings.append(f"{_key(config, role, 'cpu_offload_bytes')}: {no_block} if the KV "
                        "is float32 (it is where no CUDA device is found)")  # fmt: skip
    elif 0 < engine.cpu_offload_bytes < (snapshot_blocks + 1) * tier_block_bytes:
        # A hybrid model's cached prefix serves only with the states after it.
        warnings.append(
            f"{_key(config, role, 'cpu_offload_bytes')}: {engine.cpu_offload_bytes} bytes hold "
            f"no snapshot of this model's linear-attention states ({snapshot_blocks} blocks "
            f"of {tier_block_bytes} bytes) beside a block of its KV; no prefix the offload "
            "tier keeps could serve"
        )
    num_blocks = engine.num_blocks
    if num_blocks is None and engine.device is Device.CPU:
        num_blocks = engine.kv_cache_bytes // cpu_bpb - state_blocks
    state_bytes = shape.rank_state_bytes(tp_size, itemsize)
    return KVBudget(role, engine.block_size, max_model_len, min_blocks, bpb, cpu_bpb,
                    num_blocks, tuple(warnings), tuple(problems),
                    num_slots if state_bytes else 0, state_bytes)  # fmt: skip


def _draft_shape(config: PdserveConfig, role: Role, target: ModelShape) -> ModelShape | None:
    """The draft model's shape (``speculative_method: draft_model``), or None without
    one (an EAGLE-3 head's KV is a layer of the target's shape: checked here). Raises
    ``ConfigError`` for a draft that is not there or whose token ids are not the
    target's."""
    engine = config.engine_for(role)
    if engine.draft_model is None:
        return None
    key = _key(config, role, "draft_model")
    if engine.speculative_method is SpeculativeMethod.EAGLE3:
        _check_eagle3_head(Path(engine.draft_model), target, key, engine.tensor_parallel_size)
        return None
    draft = ModelShape.read(Path(engine.draft_model))
    if draft is None:
        raise ConfigError(key, f"{engine.draft_model} holds no config.json")
    problem = draft_vocab_problem(engine.draft_model, draft.vocab_size, target.vocab_size)
    if problem is not None:
        raise ConfigError(key, problem)
    return draft


def _check_eagle3_head(head_dir: Path, target: ModelShape, key: str, tp_size: int) -> None:
    """Raise ``ConfigError`` if ``head_dir`` holds no EAGLE-3 head whose KV fits a layer
    of ``target``'s cache, split over ``tp_size`` ranks (the engine's own checks,
    ``engine/models/eagle3.py``)."""
    path = head_dir / "config.json"
    if not path.is_file():
        raise ConfigError(key, f"{head_dir} holds no config.json")
    layer = eagle3_layer_config(json.loads(path.read_text()))
    if layer is None:
        raise ConfigError(key, f"{path} is not an EAGLE-3 head's config")
    target_kv = (target.num_kv_heads, target.head_dim)
    problem = eagle3_kv_problem(head_dir, kv_cache_heads(layer), target_kv)
    if problem is not None:
        raise ConfigError(key, problem)
    widths = {"intermediate_size": int(layer["intermediate_size"])}
    problem = split_problem(int(layer["num_attention_heads"]), target.num_kv_heads, widths, tp_size)
    if problem is not None:
        raise ConfigError(key, f"{path}: tensor_parallel_size={tp_size}: {problem}")


def _cpu_problems(
    config: PdserveConfig,
    role: Role,
    engine: EngineConfig,
    cpu_bpb: int,
    min_blocks: int,
    too_small: str,
    state_blocks: int = 0,
) -> list[tuple[str, str]]:
    """(key, message) for what would be impossible if this role's engine ran on CPU.
    ``state_blocks``: blocks a hybrid model's states take besides (``ModelShape``)."""
    if engine.device is Device.CUDA:
        return []
    budget_key = _key(config, role, "kv_cache_bytes")
    if engine.num_blocks is not None:
        needed = (engine.num_blocks + state_blocks) * cpu_bpb
        if needed > engine.kv_cache_bytes:
            return [(
                _key(config, role, "num_blocks"),
                f"{engine.num_blocks} blocks of {cpu_bpb} bytes need {_mib(needed)}, more than "
                f"{budget_key}={engine.kv_cache_bytes} ({_mib(engine.kv_cache_bytes)}), the KV "
                "budget on CPU; lower num_blocks or raise kv_cache_bytes",
            )]  # fmt: skip
        return []
    derived = engine.kv_cache_bytes // cpu_bpb - state_blocks
    if derived < min_blocks:
        states = f" (after {state_blocks} for linear-attention states)" if state_blocks else ""
        return [(budget_key, f"{_mib(engine.kv_cache_bytes)} is {derived} KV blocks{states}, "
                             f"which {too_small}")]  # fmt: skip
    return []


def _dtype_bytes(engine: EngineConfig, device: Device) -> int:
    """Bytes of one cached K or V element."""
    if engine.kv_cache_dtype.storage_name is not None:  # FP8
        return 1
    if engine.dtype is not DType.AUTO:
        return _DTYPE_BYTES[engine.dtype]
    # auto: float32 on CPU; on CUDA the checkpoint's 16-bit dtype, else bfloat16.
    return 4 if device is Device.CPU else 2


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
