"""Which part of each full parameter one tensor-parallel rank holds.

Column-parallel projections (q/k/v, gate/up, each expert's gate/up) keep the output rows
of the rank's heads or intermediate slice; row-parallel ones (o, down) keep the matching
input columns, and their partial outputs are summed across ranks (``DecoderLayer``). A
bias added after a row-parallel projection is held by rank 0 only (the others hold zeros),
so the sum adds it once. The embeddings and the LM head are split by vocabulary rows
(``llama.VocabEmbedding``; the last rank's slice padded). Everything else (norms,
routers, rotary tables) is replicated.

Fused parameters hold several pieces of the full one: rank r's ``qkv_proj`` rows are its
q rows, then its k rows, then its v rows:

    full qkv rows  | q0 q1 q2 q3 | k0 k1 | v0 v1 |     4 q heads, 2 KV heads, tp_size 2
    rank 1 holds         q2 q3      k1      v1    ->  | q2 q3 | k1 | v1 |

DeepSeek's latent attention splits by heads too: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
keep their heads' rows and ``o_proj`` their values' columns, while the latent projections
(``q_a_proj``, ``kv_a_proj_with_mqa``, their norms) are replicated: every rank caches the
whole latent, which all heads read (its KV cache is the one process's). MiniMax-M2's q/k
norms span whole projections: their gains are cut like the projections' rows, and the
mean square is summed across ranks (``norms.SplitRMSNorm``).

The loader copies each stored tensor through these specs, so a rank reads only the rows
(or columns) it keeps; LoRA adapters are cut by the same specs (``lora._shard_pair``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from common.engine_config import EngineConfig
from common.tensor_parallel import (
    HeadSplit,
    expert_split_problem,
    linear_split_problem,
    mamba_split_problem,
    split_problem,
)
from engine.models.arch import ModelArchConfig, ModelLoadError
from engine.models.arch_parts import Mamba2Config
from engine.parallel.expert_placement import Placement, loaded_placement, rank_slots


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    size: int = 1
    rank: int = 0
    # Routed experts are dealt out whole, not cut by width (``engine.expert_parallel``),
    # over this many slots beyond one per expert (``engine.num_redundant_experts``).
    expert_parallel: bool = False
    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, (self.rank, self.size)

    def expert_placement(self, num_experts: int) -> Placement | None:
        """The placement weights load into (``expert_placement.py``); None: every rank
        holds every expert (a slice of its width)."""
        if not self.expert_parallel or self.size == 1:
            return None
        return loaded_placement(num_experts, self.num_redundant_experts, self.size)


def engine_split(config: EngineConfig, rank: int) -> TensorParallel:
    """Rank ``rank``'s place in the group ``config`` describes."""
    return TensorParallel(
        config.tensor_parallel_size, rank, config.expert_parallel, config.num_redundant_experts
    )


@dataclass(frozen=True, slots=True)
class Piece:
    """Full indices ``full_start ..+ length`` are local ``local_start ..+ length``."""

    full_start: int
    length: int
    local_start: int


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How one parameter is cut. ``dim`` counts within one expert's tensor for stacked
    expert parameters (``per_expert``): 0 is the output rows (a bias's only dim), 1 the
    input columns. ``rank0_only``: rank 0 holds all of it, the others zeros."""

    dim: int = 0
    full_size: int = 0
    pieces: tuple[Piece, ...] = ()
    per_expert: bool = False
    rank0_only: bool = False
    # Expert parallelism: the expert (of ``num_experts``) in each of this rank's slots,
    # whole.
    slot_experts: tuple[int, ...] | None = None
    num_experts: int = 0

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.slot_experts is not None:
            return (self.num_experts, *local_shape[1:])
        if self.rank0_only:
            return local_shape
        axis = self.dim + (1 if self.per_expert else 0)
        return local_shape[:axis] + (self.full_size,) + local_shape[axis + 1 :]


_LAYER = r"^model\.(?:mtp_)?layers\.(\d+)\."  # the MTP layers are cut as the others
_QKV = re.compile(_LAYER + r"self_attn\.qkv_proj\.(weight|bias)$")
_O = re.compile(_LAYER + r"self_attn\.o_proj\.(weight|bias)$")
_SINKS = re.compile(_LAYER + r"self_attn\.sinks$")
# MiniMax-M2's q/k norms over whole projections: their gains are cut like the projections.
_QK_NORM = re.compile(_LAYER + r"self_attn\.(q|k)_norm\.weight$")
# Latent attention's per-head projections: queries, the latent's up-projection (W_uk, W_uv).
_MLA_HEADS = re.compile(_LAYER + r"self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$")
_MLP = re.compile(_LAYER + r"mlp\.(shared_expert\.)?(gate_up_proj|up_proj|down_proj)\.weight$")
_EXPERTS = re.compile(_LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# A hybrid model's linear-attention layers (``gated_delta_net.py``): split by heads.
_LINEAR = re.compile(_LAYER + r"linear_attn\.(in_proj|conv1d|dt_bias|A_log|out_proj)(?:\.weight)?$")
# Granite 4.0-H's and Nemotron-H's Mamba-2 layers (``mamba2.py``): split by heads, B/C by group.
_MAMBA = re.compile(_LAYER + r"mamba\.(in_proj|conv1d|dt_bias|A_log|D|norm|out_proj)"
                    r"(?:\.(weight|bias))?$")  # fmt: skip
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_split(arch: ModelArchConfig, tp: TensorParallel) -> None:
    """Raise ``ModelLoadError`` if the model cannot be split over ``tp.size`` ranks."""
    widths = split_widths(arch)
    if tp.expert_parallel and arch.moe is not None:
        del widths["moe_intermediate_size"]  # whole experts: their count must divide
        problem = expert_split_problem(arch.moe.num_experts, tp.num_redundant_experts, tp.size)
        if problem is not None:
            raise ModelLoadError(f"engine.expert_parallel: {problem}")
    problem = split_problem(arch.num_q_heads, arch.num_kv_heads, widths, tp.size)
    linear = arch.linear_attention
    if problem is None and isinstance(linear, Mamba2Config):
        problem = mamba_split_problem(linear.num_groups, linear.num_heads, tp.size)
    elif problem is None and linear is not None:
        problem = linear_split_problem(linear.num_key_heads, linear.num_value_heads, tp.size)
    if problem is not None:
        raise ModelLoadError(f"engine.tensor_parallel_size={tp.size}: {problem}")


def split_widths(arch: ModelArchConfig) -> dict[str, int]:
    """The MLP widths tensor parallelism splits, by config key."""
    moe = arch.moe
    widths = {}
    if moe is None or not all(moe.sparse_layers):
        widths["intermediate_size"] = arch.intermediate_size
    if moe is not None:
        widths["moe_intermediate_size"] = moe.expert_intermediate_size
        if moe.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return widths


def local_arch(arch: ModelArchConfig, tp: TensorParallel) -> ModelArchConfig:
    """The architecture of one rank's shard: its heads and its slice of every width."""
    if tp.size == 1:
        return arch
    check_split(arch, tp)
    heads = HeadSplit(arch.num_q_heads, arch.num_kv_heads, tp.size, tp.rank)
    moe = arch.moe
    if moe is not None:
        placement = tp.expert_placement(moe.num_experts)
        moe = dataclasses.replace(
            moe,
            expert_intermediate_size=moe.expert_intermediate_size
            // (1 if placement is not None else tp.size),
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // tp.size,
            expert_placement=placement,
            expert_rank=tp.rank,
            num_expert_ranks=tp.size,
        )
    linear = arch.linear_attention
    if isinstance(linear, Mamba2Config):  # its heads, and its groups' B and C (or a copy)
        linear = dataclasses.replace(
            linear,
            num_heads=linear.num_heads // tp.size,
            num_groups=max(1, linear.num_groups // tp.size),
            group_ranks=max(1, tp.size // linear.num_groups),
        )
    elif linear is not None:  # each rank its share of the key and value heads
        linear = dataclasses.replace(
            linear,
            num_key_heads=linear.num_key_heads // tp.size,
            num_value_heads=linear.num_value_heads // tp.size,
        )
    return dataclasses.replace(
        arch,
        num_q_heads=heads.q_heads,
        num_kv_heads=heads.kv_heads,
        intermediate_size=arch.intermediate_size // tp.size,
        moe=moe,
        linear_attention=linear,
    )


def _halves(width: int, tp: TensorParallel) -> tuple[Piece, ...]:
    """Rows of a gate/up pair (gate rows, then up rows) that rank ``tp.rank`` keeps."""
    local = width // tp.size
    start = tp.rank * local
    return (Piece(start, local, 0), Piece(width + start, local, local))


def shard_spec(name: str, arch: ModelArchConfig, tp: TensorParallel) -> ShardSpec | None:
    """How parameter ``name`` of the full model is cut for rank ``tp.rank``; None: every
    rank holds all of it."""
    if tp.size == 1:
        return None
    if name in _VOCAB:  # rows of the rank's vocabulary slice; the rest of it is padding
        rows = -(-arch.vocab_size // tp.size)
        start = tp.rank * rows
        return ShardSpec(0, arch.vocab_size, (Piece(start, min(rows, arch.vocab_size - start), 0),))
    heads = HeadSplit(arch.num_q_heads, arch.num_kv_heads, tp.size, tp.rank)
    if arch.mla is not None and (spec := _mla_spec(name, arch, heads)) is not None:
        return spec
    if arch.mamba2 is not None and (match := _MAMBA.match(name)):
        return _mamba_spec(match.group(2), match.group(3), arch.mamba2, tp)
    if arch.linear_attention is not None and (match := _LINEAR.match(name)):
        return _linear_spec(match.group(2), arch, tp)
    head_dim = arch.head_dim
    q_rows = (heads.q_head_start * head_dim, heads.q_heads * head_dim)
    kv_start, kv_rows = heads.kv_head_start * head_dim, heads.kv_heads * head_dim
    if match := _QKV.match(name):
        # Qwen3.5's output gate: each head's query rows, then its gate's (``llama.py``).
        gated = 2 if arch.attention_output_gate else 1
        q_size, kv_size = arch.q_size * gated, arch.kv_size
        q_start, q_length = q_rows[0] * gated, q_rows[1] * gated
        pieces = (
            Piece(q_start, q_length, 0),
            Piece(q_size + kv_start, kv_rows, q_length),
            Piece(q_size + kv_size + kv_start, kv_rows, q_length + kv_rows),
        )
        return ShardSpec(0, q_size + 2 * kv_size, pieces)
    if match := _O.match(name):
        if match.group(2) == "bias":
            return ShardSpec(rank0_only=True)
        return ShardSpec(1, arch.q_size, (Piece(q_rows[0], q_rows[1], 0),))
    if arch.qk_norm_whole and (match := _QK_NORM.match(name)):
        if match.group(2) == "q":
            return ShardSpec(0, arch.q_size, (Piece(q_rows[0], q_rows[1], 0),))
        return ShardSpec(0, arch.kv_size, (Piece(kv_start, kv_rows, 0),))
    if _SINKS.match(name):
        return ShardSpec(0, arch.num_q_heads, (Piece(heads.q_head_start, heads.q_heads, 0),))
    if match := _MLP.match(name):
        width = arch.intermediate_size
        if match.group(2):  # the shared expert
            assert arch.moe is not None
            width = arch.moe.shared_expert_intermediate_size
        return _mlp_spec(match.group(3), width, tp, per_expert=False)
    if match := _EXPERTS.match(name):
        assert arch.moe is not None
        placement = tp.expert_placement(arch.moe.num_experts)
        if placement is not None:  # whole experts: the rank's slots' experts
            slot_experts = rank_slots(placement, tp.rank, tp.size)
            return ShardSpec(per_expert=True, slot_experts=slot_experts,
                             num_experts=arch.moe.num_experts)  # fmt: skip
        which, bias = match.group(2), match.group(3)
        if which == "down_proj" and bias:
            return ShardSpec(per_expert=True, rank0_only=True)
        if which == "gate_up_proj" and arch.moe.expert_activation == "relu2":
            which = "up_proj"  # (Nemotron-H's ungated experts: up rows alone)
        return _mlp_spec(which, arch.moe.expert_intermediate_size, tp, per_expert=True)
    return None


def _linear_spec(which: str, arch: ModelArchConfig, tp: TensorParallel) -> ShardSpec:
    """A linear-attention layer's parameters, cut by heads: the q, k and v channels of
    the rank's key and value heads (the convolution's, and the rows of ``in_proj`` that
    feed it: they share their order), its value heads' gate, beta and decay rows (the
    rest of ``in_proj``, each part cut alike) and ``dt_bias`` / ``A_log``, and their
    columns of ``out_proj`` (row-parallel: partial sums, added up by the layer's
    all-reduce). Rank r's value heads read rank r's key heads, as the full model's do
    (value head j reads key head ``j // (num_value_heads / num_key_heads)``)."""
    linear = arch.linear_attention
    assert linear is not None
    keys = linear.num_key_heads // tp.size * linear.key_head_dim
    value_heads = linear.num_value_heads // tp.size
    values = value_heads * linear.value_head_dim
    key_start, value_start = tp.rank * keys, tp.rank * values
    channels = (
        Piece(key_start, keys, 0),
        Piece(linear.key_dim + key_start, keys, keys),
        Piece(2 * linear.key_dim + value_start, values, 2 * keys),
    )
    heads = Piece(tp.rank * value_heads, value_heads, 0)  # one row per value head
    if which == "conv1d":
        return ShardSpec(0, linear.conv_dim, channels)
    if which == "out_proj":
        return ShardSpec(1, linear.value_dim, (Piece(value_start, values, 0),))
    if which != "in_proj":  # dt_bias, A_log
        return ShardSpec(0, linear.num_value_heads, (heads,))
    # in_proj: each part's pieces, moved to where the part starts, full and local
    parts = (channels, (Piece(value_start, values, 0),), (heads,), (heads,))
    pieces, full_start, local_start = [], 0, 0
    for part, width in zip(parts, linear.in_proj_widths, strict=True):
        pieces += [Piece(full_start + p.full_start, p.length, local_start + p.local_start)
                   for p in part]  # fmt: skip
        full_start += width
        local_start += width // tp.size
    return ShardSpec(0, full_start, tuple(pieces))


def _mamba_spec(which: str, kind: str | None, mamba: Mamba2Config, tp: TensorParallel) -> ShardSpec:
    """A Mamba-2 layer's parameters, cut by heads: the x channels of the rank's heads (the
    convolution's, and the rows of ``in_proj`` that feed it) with the B and C channels of
    the groups they read (a share of the groups, or one group copied on ``tp.size /
    num_groups`` ranks), its heads' gate rows (z) and time-step rows, ``dt_bias`` /
    ``A_log`` / ``D``, the norm's gains of its channels, and their columns of ``out_proj``
    (row-parallel: partial sums, added up by the layer's all-reduce; its bias rank 0's)."""
    width = mamba.intermediate_size
    local_width, local_heads = width // tp.size, mamba.num_heads // tp.size
    local_groups = max(1, mamba.num_groups // tp.size)
    group_start = tp.rank * mamba.num_groups // tp.size
    state, x_start = mamba.state_size, tp.rank * local_width
    channels = (
        Piece(x_start, local_width, 0),
        Piece(width + group_start * state, local_groups * state, local_width),
        Piece(width + (mamba.num_groups + group_start) * state, local_groups * state,
              local_width + local_groups * state),
    )  # fmt: skip
    heads = Piece(tp.rank * local_heads, local_heads, 0)
    if which == "conv1d":
        return ShardSpec(0, mamba.conv_dim, channels)
    if which == "out_proj":
        if kind == "bias":
            return ShardSpec(rank0_only=True)
        return ShardSpec(1, width, (Piece(x_start, local_width, 0),))
    if which == "norm":
        return ShardSpec(0, width, (Piece(x_start, local_width, 0),))
    if which != "in_proj":  # dt_bias, A_log, D
        return ShardSpec(0, mamba.num_heads, (heads,))
    # in_proj: z, then the convolution's channels, then the time steps
    local_conv = local_width + 2 * local_groups * state
    pieces = (
        Piece(x_start, local_width, 0),
        *(Piece(width + p.full_start, p.length, local_width + p.local_start) for p in channels),
        Piece(width + mamba.conv_dim + heads.full_start, local_heads, local_width + local_conv),
    )
    return ShardSpec(0, sum(mamba.in_proj_widths), pieces)


def _mla_spec(name: str, arch: ModelArchConfig, heads: HeadSplit) -> ShardSpec | None:
    """Latent attention's head-split parameters: rows ``[heads, per-head width]`` of the
    queries (nope + rope dims) and of ``kv_b_proj`` (nope + value dims), the value
    columns of ``o_proj``; None for the rest (replicated, or not attention's)."""
    mla = arch.mla
    assert mla is not None
    if match := _MLA_HEADS.match(name):
        width = mla.qk_nope_head_dim + (
            mla.v_head_dim if match.group(2) == "kv_b_proj" else mla.qk_rope_head_dim
        )
        rows = Piece(heads.q_head_start * width, heads.q_heads * width, 0)
        return ShardSpec(0, arch.num_q_heads * width, (rows,))
    if (match := _O.match(name)) and match.group(2) == "weight":
        width = mla.v_head_dim
        columns = Piece(heads.q_head_start * width, heads.q_heads * width, 0)
        return ShardSpec(1, arch.num_q_heads * width, (columns,))
    return None


def _mlp_spec(which: str, width: int, tp: TensorParallel, per_expert: bool) -> ShardSpec:
    if which == "gate_up_proj":
        return ShardSpec(0, 2 * width, _halves(width, tp), per_expert)
    local = width // tp.size
    # up_proj (Nemotron-H's ungated MLP): its rows; down_proj: its columns
    return ShardSpec(int(which == "down_proj"), width, (Piece(tp.rank * local, local, 0),),
                     per_expert)  # fmt: skip
