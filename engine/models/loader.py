"""Load a Llama-family model from a local Hugging Face directory (config.json + safetensors).

Handles one file (``model.safetensors``) or shards (``model.safetensors.index.json``), maps
the checkpoint's separate q/k/v and gate/up tensors (and a linear-attention layer's four
input projections) into the fused projections, and each
expert's tensors (Qwen's ``mlp.experts.{e}.{gate|up|down}_proj``, Mixtral's
``block_sparse_moe.experts.{e}.{w1|w3|w2}``) into the stacked expert weights (files in
transformers 5's stacked layout load as they are), ties the LM head to the embeddings when
the config says so (unless the file stores a different head, which transformers then uses
untied), and fails with a message naming the missing file or tensor. Multimodal checkpoints
served for text (Gemma 3's) load their language model's tensors and skip the rest; GPT-OSS's
experts (interleaved, input-major, maybe MXFP4) go through ``gpt_oss_weights.py``; FP8
weights are dequantized with the scales stored beside them (``fp8_weights.py``), GPTQ's,
AWQ's and compressed-tensors' packed integers with their scales and zeros
(``int_weights.py``). DeepSeek's rotary rows are reordered (``mla.rope_rows_in_halves``);
multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's) are left out, or loaded as
``model.mtp_layers`` when the engine drafts with them (``mtp.py``). Granite 4.0-H's
experts and shared MLP (``_granite_name``) and Nemotron-H's ``backbone.layers.{i}.mixer``
(``_nemotron_name``) are renamed into the engine's modules.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.hf_config import MTP_LAYER_ARCHITECTURES
from common.model_info import BARE_NAMES
from engine.attention.backend import AttentionBackend
from engine.models.arch import ModelArchConfig, ModelLoadError
from engine.models.arch_parts import IN_PROJ_PARTS
from engine.models.bnb_config import SIDECAR_SUFFIXES as BNB_SIDECARS
from engine.models.bnb_weights import dequantize_bnb4
from engine.models.checkpoint_files import safetensors_files
from engine.models.empty_init import materialize
from engine.models.fp8_config import SCALE_SUFFIXES, SIDECAR_SUFFIXES
from engine.models.fp8_weights import FLOAT8_DTYPES, dequantize_fp8
from engine.models.gpt_oss_weights import EXPERT_TENSOR, expert_pieces
from engine.models.int_weights import dequantize_int
from engine.models.int_weights_config import IntWeights
from engine.models.kv_scales import KvScaleReader, kv_scale_of
from engine.models.llama import LlamaForCausalLM
from engine.models.mla import rope_rows_in_halves
from engine.models.moe import DeepseekGate, SparseMoe
from engine.models.mtp import SHARED_WITH_MODEL, add_mtp_layer
from engine.models.stacked_experts import STACKED_EXPERTS, stacked_expert_pieces
from engine.parallel.group import SingleRank, TPGroup
from engine.parallel.shard_spec import ShardSpec, TensorParallel, local_arch, shard_spec

logger = logging.getLogger(__name__)

_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# A multimodal checkpoint's language model (transformers 4's names, which 5 also writes,
# then 5's own), and the parts of it a text-only engine leaves unloaded.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))  # fmt: skip
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.", "visual.", "model.visual.")  # fmt: skip
# Qwen3.5's MTP layer (``mtp.*``, beside the model): its names as DeepSeek's (``mtp.py``).
_QWEN_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
_QWEN_MTP_PARTS = {"mtp.fc.weight": "eh_proj.weight",
                   "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
                   "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
                   "mtp.norm.weight": "shared_head.norm.weight"}  # fmt: skip
_FUSED = re.compile(
    r"^(model\.(?:mtp_)?layers\.\d+\.(?:self_attn|mlp|mlp\.shared_expert))"
    r"\.(q|k|v|gate|up)_proj\.(weight|bias)$"
)
# A linear-attention layer's four input projections, fused into its ``in_proj``.
_LINEAR_IN = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight$")
# Qwen3-Next's two, each interleaved per key head (``_qwen3_next_in_proj``).
_NEXT_IN = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.in_proj_(qkvz|ba)\.weight$")
_EXPERT = re.compile(
    r"^(model\.(?:mtp_)?layers\.\d+\.mlp\.experts)\.(\d+)"
    r"\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
# Mixtral's per-expert names: w1 is the gate, w3 the up and w2 the down projection.
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}  # fmt: skip


# Granite's MoE and shared-MLP names (as released, then transformers 5's) -> the engine's.
_GRANITE_NAMES = ((".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
                  (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
                  (".block_sparse_moe.router.layer.weight", ".mlp.gate.weight"),
                  (".block_sparse_moe.router.weight", ".mlp.gate.weight"),
                  (".block_sparse_moe.experts.", ".mlp.experts."))  # fmt: skip


# Nemotron-H's layers: ``backbone.layers.{i}.norm`` / ``.mixer.*`` (``llama.SingleBlockLayer``).
_NEMOTRON_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(norm|mixer)\.(.*)$")
_NEMOTRON_BLOCKS = {"mamba": "mamba", "attention": "self_attn", "mlp": "mlp", "moe": "mlp"}
_NEMOTRON_NAMES = {"backbone.embeddings.weight": _EMBED,
                   "backbone.norm_f.weight": "model.norm.weight"}  # fmt: skip


def _nemotron_name(name: str, arch: ModelArchConfig) -> str:
    """Nemotron-H's tensor ``name`` as the engine's: the embeddings, final norm, and each
    layer's norm and block (``mixer``) under the block's name for its kind."""
    if name in _NEMOTRON_NAMES:
        return _NEMOTRON_NAMES[name]
    layer = _NEMOTRON_LAYER.match(name)
    if layer is None:
        return name
    index, part, rest = layer.groups()
    if part == "norm":
        return f"model.layers.{index}.input_layernorm.{rest}"
    kind = arch.block_kinds[int(index)] if int(index) < len(arch.block_kinds) else ""
    return f"model.layers.{index}.{_NEMOTRON_BLOCKS.get(kind, 'mixer')}.{rest}"


# Bamba's names for what Granite 4.0-H's layers and Llama call otherwise.
_BAMBA_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("model.final_layernorm.", "model.norm."))  # fmt: skip


def _bamba_name(name: str) -> str:
    for old, new in _BAMBA_NAMES:
        name = name.replace(old, new)
    return name


def _granite_name(name: str, arch: ModelArchConfig) -> str:
    """Granite 4.0-H's tensor ``name`` as the engine's: its experts stacked as
    ``moe.Experts`` holds them ([E, 2I, H] gate rows first, [E, H, I]), its shared MLP
    (``shared_mlp.input_linear``: gate rows, then up) the shared expert's, or the dense
    MLP when the model has no experts."""
    for old, new in _GRANITE_NAMES:
        if old in name:
            return name.replace(old, new)
    mlp = ".mlp.shared_expert." if arch.moe is not None else ".mlp."
    name = name.replace(".shared_mlp.input_linear.", f"{mlp}gate_up_proj.")
    return name.replace(".shared_mlp.output_linear.", f"{mlp}down_proj.")


@dataclass(frozen=True, slots=True)
class _Target:
    """Where a stored tensor goes: rows ``row_start ..+ rows`` of ``param`` (of
    ``param[expert]``); ``rows`` None: all rows from ``row_start`` on. The stored tensor
    must have exactly that many: checked only to fit, a q_proj 64 rows too long beside a
    k_proj 64 rows too short loaded, the fused qkv_proj's last rows never written."""

    param: str
    row_start: int = 0
    expert: int | None = None
    rows: int | None = None


def _target(name: str, arch: ModelArchConfig, shapes: dict[str, tuple[int, ...]]) -> _Target:
    """Where the checkpoint tensor ``name`` goes in the model (maybe a missing parameter),
    in the coordinates of the full parameter (``shapes``: full shapes by name)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MLP
    name = name.replace(".mlp.router.", ".mlp.gate.")  # GPT-OSS's name for the router
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # DeepSeek's
    if name.endswith(".mlp.e_score_correction_bias"):  # MiniMax-M2's, beside its router
        name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
    expert = _EXPERT.match(name)
    if expert is not None:
        prefix, index, which = expert.groups()
        part = _EXPERT_PART[which]
        if part == "down":
            return _Target(f"{prefix}.down_proj", 0, int(index))
        stacked = f"{prefix}.gate_up_proj"
        half = shapes[stacked][1] // 2 if stacked in shapes else 0
        if arch.moe is not None and arch.moe.expert_activation == "relu2":
            return _Target(stacked, 0, int(index))  # up rows alone (Nemotron-H's ungated)
        return _Target(stacked, 0 if part == "gate" else half, int(index), half)
    linear = _LINEAR_IN.match(name) if arch.linear_attention is not None else None
    if linear is not None:
        module, which = linear.groups()
        widths = arch.linear_attention.in_proj_widths
        return _Target(f"{module}.in_proj.weight", arch.linear_attention.in_proj_start(which),
                       rows=widths[IN_PROJ_PARTS.index(which)])  # fmt: skip
    fused = _FUSED.match(name)
    if fused is None or name in shapes:
        # (a projection the model holds as stored: latent attention's q_proj, Nemotron-H's
        # ungated up_proj)
        return _Target(name)
    module, which, kind = fused.groups()
    if which in ("q", "k", "v"):
        q_rows = arch.q_size * (2 if arch.attention_output_gate else 1)  # Qwen3.5's gate
        starts = {"q": 0, "k": q_rows, "v": q_rows + arch.kv_size}
        rows = q_rows if which == "q" else arch.kv_size
        return _Target(f"{module}.qkv_proj.{kind}", starts[which], rows=rows)
    stacked = f"{module}.gate_up_proj.{kind}"
    half = shapes[stacked][0] // 2 if stacked in shapes else 0
    return _Target(stacked, 0 if which == "gate" else half, rows=half)


def _mtp_name(name: str, arch: ModelArchConfig, num_mtp_layers: int) -> str | None:
    """``name`` itself, or for a multi-token-prediction layer's tensor (stored after the
    ``num_hidden_layers`` the model runs, ``MTP_LAYER_ARCHITECTURES``) its name in
    ``model.mtp_layers`` when the model has that layer. None: not loaded (the layer is
    not used, as transformers leaves it, or the tensor copies one of the model's).
    Qwen3.5 stores its layer as ``mtp.*``: one set of inputs and norms (the first
    layer's), then ``mtp.layers.{i}``."""
    if name.startswith("mtp."):
        if not num_mtp_layers:
            return None
        if name in _QWEN_MTP_PARTS:
            return f"model.mtp_layers.0.{_QWEN_MTP_PARTS[name]}"
        layer = _QWEN_MTP_LAYER.match(name)
        if layer is None or int(layer.group(1)) >= num_mtp_layers:
            return None
        return f"model.mtp_layers.{layer.group(1)}.{layer.group(2)}"
    if arch.architecture not in MTP_LAYER_ARCHITECTURES:
        return name
    layer = _LAYER_INDEX.match(name)
    if layer is None or int(layer.group(1)) < arch.num_layers:
        return name
    index = int(layer.group(1)) - arch.num_layers
    if index >= num_mtp_layers or layer.group(2) in SHARED_WITH_MODEL:
        return None
    return f"model.mtp_layers.{index}.{layer.group(2)}"


def _qwen3_next_in_proj(
    module: str, which: str, tensor: torch.Tensor, arch: ModelArchConfig
) -> tuple[_Target, torch.Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``: per key head, its query, key, the
    values and gates of its value heads (``[q k v z]`` each), or their betas and decays
    (``[b a]``), as transformers' ``fix_query_key_value_ordering`` reads them. Reordered
    into Qwen3.5's rows (all queries, keys, values, then gates; all betas, then decays),
    which the fused ``in_proj`` takes at the part's start (``in_proj_widths``)."""
    linear = arch.linear_attention
    assert linear is not None
    groups = linear.num_key_heads
    per_group = linear.num_value_heads // groups
    if which == "qkvz":
        widths = [linear.key_head_dim, linear.key_head_dim, per_group * linear.value_head_dim,
                  per_group * linear.value_head_dim]  # fmt: skip
        first = "qkv"
    else:
        widths, first = [per_group, per_group], "b"
    if tensor.shape[0] != groups * sum(widths):
        raise ModelLoadError(f"{module}.in_proj_{which}.weight has {tensor.shape[0]} rows; "
                             f"this config needs {groups * sum(widths)}")  # fmt: skip
    parts = tensor.reshape(groups, sum(widths), -1).split(widths, dim=1)
    rows = torch.cat([part.reshape(-1, tensor.shape[-1]) for part in parts])
    return _Target(f"{module}.in_proj.weight", linear.in_proj_start(first), rows=len(rows)), rows


def _model_name(name: str) -> str | None:
    """The model's name for checkpoint tensor ``name``; None: not the language model's."""
    if name.startswith(_NOT_TEXT):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    if name.startswith(BARE_NAMES):
        return "model." + name
    return name


def _tensor_names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def _partner(
    stored: str, suffix: str, partner_suffix: str, where: dict[str, Path], path: Path
) -> Callable[[], torch.Tensor]:
    """A reader of the tensor stored beside ``stored`` (MXFP4 scales beside their blocks),
    maybe in another shard."""
    name = stored.removesuffix(suffix) + partner_suffix
    if name not in where:
        raise ModelLoadError(f"{path.name}: {stored} has no {name} in the checkpoint")

    def read() -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    return read


def _dequantized(
    stored: str,
    tensor: torch.Tensor,  # as stored
    f: Any,  # the open file holding it
    arch: ModelArchConfig,
    where: dict[str, Path],
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Of an FP8 checkpoint's tensor: an FP8 one times the scales stored beside it, in
    ``dtype`` and computed on ``device`` (benchmarks/results/fp8_load_cpu.md: ~1 G weights/s
    on the small model's tensors on this 2-core CPU, 0.37 G/s on an 8B model's largest); a
    float one as it is. An integer one is refused: the engine has
    no integer weights, and casting one would drop its scale."""
    fp8 = arch.fp8_weights
    assert fp8 is not None
    if tensor.dtype not in FLOAT8_DTYPES:
        if not tensor.is_floating_point():
            raise ModelLoadError(f"{path.name}: {stored} is stored as {tensor.dtype}; only "
                                 "FP8 or floating-point weights load")  # fmt: skip
        return tensor
    scale_name = next((stored + s for s in SCALE_SUFFIXES if stored + s in where), None)
    if scale_name is None:
        raise ModelLoadError(
            f"{path.name}: {stored} is stored as {tensor.dtype} with no "
            f"{' or '.join(stored + suffix for suffix in SCALE_SUFFIXES)} beside it"
        )
    if where[scale_name] == path:
        scales = f.get_tensor(scale_name)
    else:
        scales = _partner(stored, "", scale_name.removeprefix(stored), where, path)()
    if scales.dtype == torch.uint8 and fp8.scale_format == "ue8m0":
        scales = scales.view(torch.float8_e8m0fnu)  # exponent bytes: 2 ** (byte - 127)
    if not scales.is_floating_point():
        raise ModelLoadError(f"{path.name}: {scale_name} is stored as {scales.dtype}; scales "
                             "are floats (or E8M0 bytes with scale_fmt ue8m0)")  # fmt: skip
    return dequantize_fp8(tensor.to(device), scales.to(device), fp8.block_size, dtype, stored)


def _unpacked(
    stored: str,
    qweight: torch.Tensor,
    where: dict[str, Path],
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    ints: IntWeights,
) -> torch.Tensor:
    """A GPTQ, AWQ or compressed-tensors projection's weight [out, in] in ``dtype``:
    ``stored`` (its packed values) with the zeros, scales, group indices and shape stored
    beside it, maybe in another shard; dequantized on ``device``."""
    names = ints.names
    base = stored.removesuffix(names.packed)
    layout = ints.for_module(base)
    if layout is None:
        raise ModelLoadError(
            f"{path.name}: {stored}: the quantization_config's dynamic rules leave this "
            "module unquantized, but it is stored packed"
        )

    def beside(suffix: str | None, required: bool) -> torch.Tensor | None:
        if suffix is None or (base + suffix not in where and not required):
            return None
        return _partner(stored, names.packed, suffix, where, path)().to(device)

    zeros = beside(names.zeros, required=layout.has_zeros)
    scales = beside(names.scales, required=True)
    g_idx = beside(names.g_idx, required=False)
    shape = beside(names.shape, required=False)
    assert scales is not None
    weight_shape = None if shape is None else (int(shape[0]), int(shape[1]))
    return dequantize_int(layout, qweight.to(device), zeros, scales, g_idx, dtype, base,
                          weight_shape)  # fmt: skip


def _bnb_unpacked(
    stored: str,
    packed: torch.Tensor,
    where: dict[str, Path],
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A bitsandbytes 4-bit weight in ``dtype``: ``stored`` with the quantization state
    stored beside it (``X.weight.absmax``, ...), maybe in another shard."""
    state = {}
    for suffix in BNB_SIDECARS:
        if stored.removesuffix(".weight") + suffix in where:
            key = suffix.removeprefix(".weight.")
            state[key] = _partner(stored, ".weight", suffix, where, path)().to(device)
    return dequantize_bnb4(packed.to(device), state, dtype, stored)


def _take_sidecar(name: str, stored: str, f: Any, path: Path, kv_scales: KvScaleReader) -> None:
    """A scale stored beside an FP8 checkpoint's weights: weight scales are read with their
    weights, KV-cache scales kept for an FP8 cache, activation scales unused; ModelOpt's
    pre-quantization scales (AWQ-style smoothing) change what a layer computes: refused."""
    if name.endswith("pre_quant_scale"):
        raise ModelLoadError(f"{path.name}: {stored}: pre-quantization scales are not supported")
    kv_scales.add(name, lambda: f.get_tensor(stored))


def _stored_head_differs(files: list[Path]) -> bool:
    """Whether the checkpoint stores an ``lm_head.weight`` that is not the embeddings."""
    where: dict[str, tuple[Path, str]] = {}  # model name -> (file, stored name)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if (name := _model_name(stored)) in (_HEAD, _EMBED):
                    where[name] = (path, stored)
    if len(where) < 2:
        return False
    tensors = []
    for path, stored in where.values():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors.append(f.get_tensor(stored))
    # A head stored in another dtype (an FP8 head beside 16-bit embeddings) is its own.
    return tensors[0].dtype != tensors[1].dtype or not torch.equal(tensors[0], tensors[1])


def load_model(
    model_dir: str | Path,
    arch: ModelArchConfig,
    max_positions: int,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    group: TPGroup | None = None,
    num_mtp_layers: int = 0,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """The model (of ``arch``, the full architecture), or under tensor parallelism the
    shard of rank ``group.rank``: each stored tensor is cut by ``shard_spec`` as it is
    read, so a rank copies only what it keeps. ``num_mtp_layers``: the checkpoint's
    multi-token-prediction layers to load too (0 or 1; ``mtp.py``); ``tp``: the group's
    split (``engine_split``: with expert parallelism each rank loads the whole experts of
    its slots); None: the group's, with experts cut by width."""
    model_dir = Path(model_dir)
    group = group or SingleRank()
    tp = tp or TensorParallel(group.size, group.rank)
    assert (tp.size, tp.rank) == (group.size, group.rank), (tp, group.rank, group.size)
    files = safetensors_files(model_dir)
    if arch.tie_word_embeddings and _stored_head_differs(files):
        # transformers (5) keeps such a head untied and uses it; so do we, for parity.
        logger.warning("%s: tie_word_embeddings is set but lm_head.weight differs from the "
                       "embeddings; using it untied, as transformers does", model_dir)  # fmt: skip
        arch = dataclasses.replace(arch, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(local_arch(arch, tp), max_positions, backend, group)
        if num_mtp_layers:
            add_mtp_layer(model, backend, group)
    model = materialize(model, device, dtype)
    for module in model.modules():
        if isinstance(module, DeepseekGate):  # routes in float32, as transformers
            module.float()
        if isinstance(module, SparseMoe) and module.expert_placement is not None:
            module.set_placement(module.expert_placement)  # its tables, made empty
    model.build_rope_tables(device)
    params = dict(model.named_parameters())
    specs = {name: spec for name in params if (spec := shard_spec(name, arch, tp)) is not None}
    # Full shapes: stored tensors are placed in the full parameter's coordinates.
    shapes = {
        name: specs[name].full_shape(tuple(p.shape)) if name in specs else tuple(p.shape)
        for name, p in params.items()
    }
    # Elements of each parameter filled so far, to detect missing tensors.
    filled: dict[str, int] = dict.fromkeys(params, 0)
    unexpected: list[str] = []
    gpt_oss = arch.architecture == "GptOssForCausalLM"
    granite = arch.architecture == "GraniteMoeHybridForCausalLM"
    bamba = arch.architecture == "BambaForCausalLM"
    fp8 = arch.fp8_weights
    # stored name -> file, for scales stored in another shard than their weights
    ints, bnb = arch.int_weights, arch.bnb_weights
    scaled = gpt_oss or fp8 is not None or ints is not None or bnb is not None
    where = {name: path for path in files for name in _tensor_names(path)} if scaled else {}
    kv_scales = KvScaleReader(declared=arch.fp8_kv_scales)

    def place(target: _Target, tensor: torch.Tensor, stored: str, path: Path) -> None:
        if target.param not in params:
            unexpected.append(stored)
            return
        spec = specs.get(target.param)
        dest, full = params[target.param].data, shapes[target.param]
        dests = [dest]
        if target.expert is not None:
            if target.expert >= full[0]:
                raise ModelLoadError(
                    f"{path.name}: {stored} names expert {target.expert} of {full[0]}"
                )
            slots = [target.expert]
            if spec is not None and spec.slot_experts is not None:  # expert parallelism
                # The rank's slots holding this expert (none: other ranks hold it).
                slots = [i for i, e in enumerate(spec.slot_experts) if e == target.expert]
            dests, full = [dest[slot] for slot in slots], full[1:]
        elif spec is not None and spec.per_expert:  # all experts at once: one by one
            for expert in range(tensor.shape[0]):
                place(dataclasses.replace(target, expert=expert), tensor[expert], stored, path)
            return
        rows = full[0] - target.row_start if target.rows is None else target.rows
        if tuple(tensor.shape) != (rows, *full[1:]) or target.row_start + rows > full[0]:
            part = "" if target.rows is None else f" (its rows {target.row_start}..+{rows})"
            raise ModelLoadError(
                f"{path.name}: {stored} has shape {tuple(tensor.shape)}; this config needs "
                f"{(rows, *full[1:])} for {target.param} {shapes[target.param]}{part}"
            )
        with torch.no_grad():  # copy_ casts to the model dtype
            for dest in dests:
                written = copy_shard(dest, tensor, target.row_start, spec, tp.rank)
                filled[target.param] += written

    bare = False  # the backbone saved alone (names without "model.")
    # Names read so far: a tensor stored in two shards is read once (counted twice, it
    # filled a fused parameter in place of a part missing from the files, left zero).
    read: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if stored in read:
                    logger.warning("%s: %s is stored again; the first copy is used",
                                   path.name, stored)  # fmt: skip
                    continue
                read.add(stored)
                name = _model_name(stored)
                if name is not None:
                    name = _mtp_name(name, arch, num_mtp_layers)
                if name is not None and granite:
                    name = _granite_name(name, arch)
                if name is not None and bamba:
                    name = _bamba_name(name)
                if name is not None and arch.block_kinds:
                    name = _nemotron_name(name, arch)
                if name is None or _IGNORED.match(name):
                    continue
                bare = bare or stored.startswith(BARE_NAMES)
                if fp8 is not None and name.endswith(SIDECAR_SUFFIXES) and name not in params:
                    _take_sidecar(name, stored, f, path, kv_scales)
                    continue
                if kv_scale_of(name) is not None and name not in params:  # any weights'
                    kv_scales.add(name, lambda stored=stored, f=f: f.get_tensor(stored))
                    continue
                if ints is not None and name.endswith(ints.names.sidecars) and name not in params:
                    continue  # read with the packed weight beside it
                if bnb is not None and name.endswith(BNB_SIDECARS) and name not in params:
                    continue  # read with the weight it quantizes
                if arch.tie_word_embeddings and name == _HEAD:
                    continue
                stacked = STACKED_EXPERTS.match(name) if arch.moe and not gpt_oss else None
                if stacked is not None and name not in shapes:  # a dense layer's
                    unexpected.append(stored)
                    continue
                if stacked is not None and f.get_slice(stored).get_dtype().startswith("F8"):
                    raise ModelLoadError(f"{path.name}: {stored}: stacked experts in FP8 are "
                                         "not supported")  # fmt: skip
                if stacked is not None:
                    prefix, which = stacked.groups()
                    pieces = stacked_expert_pieces(
                        prefix, which, f.get_tensor(stored), shapes[name], f"{path.name}: {stored}"
                    )
                    for param, index, row_start, rows in pieces:
                        place(_Target(param, row_start, index, len(rows)), rows, stored, path)
                    continue
                expert = EXPERT_TENSOR.match(name) if gpt_oss else None
                if expert is None:
                    tensor = f.get_tensor(stored)
                    if ints is not None and name.endswith(ints.names.packed):
                        tensor = _unpacked(stored, tensor, where, path, device, dtype, ints)
                        name = name.removesuffix(ints.names.packed) + ".weight"
                    elif bnb is not None and tensor.dtype == torch.uint8:
                        tensor = _bnb_unpacked(stored, tensor, where, path, device, dtype)
                    elif fp8 is not None:
                        tensor = _dequantized(stored, tensor, f, arch, where, path, device, dtype)
                    elif tensor.dtype in FLOAT8_DTYPES:
                        raise ModelLoadError(
                            f"{path.name}: {stored} is stored as {tensor.dtype} but config.json "
                            "names no FP8 quantization_config to say how it is scaled"
                        )
                    if arch.mla is not None:
                        tensor = rope_rows_in_halves(name, tensor, arch)
                    next_in = _NEXT_IN.match(name) if arch.linear_attention else None
                    if next_in is not None:  # Qwen3-Next's: into Qwen3.5's order
                        target, tensor = _qwen3_next_in_proj(*next_in.groups(), tensor, arch)
                        place(target, tensor, stored, path)
                        continue
                    place(_target(name, arch, shapes), tensor, stored, path)
                    continue
                prefix, which, suffix = expert.group(1), expert.group(2), expert.group(3) or ""
                if suffix == "_scales":
                    continue  # read with its blocks
                if f.get_slice(stored).get_dtype().startswith("F8"):
                    raise ModelLoadError(f"{path.name}: {stored}: GPT-OSS experts in FP8 are not "
                                         "supported (MXFP4 or 16-bit are)")  # fmt: skip
                scales = None
                if suffix == "_blocks":
                    scales = _partner(stored, "_blocks", "_scales", where, path)
                pieces = expert_pieces(prefix, which, suffix, f.get_tensor(stored), scales, dtype)
                for param, index, row_start, rows in pieces:
                    place(_Target(param, row_start, index, len(rows)), rows, stored, path)
    model.checkpoint_kv_scales = kv_scales.per_layer(model_dir)
    model.kv_scale_problems = tuple(kv_scales.problems)
    dequantized = _dequantized_kind(arch)
    if dequantized is not None and group.rank == 0:  # why they take the model dtype's memory
        held = sum(p.numel() * p.element_size() for p in params.values())
        kind, missing = dequantized
        logger.info("%s: %s dequantized to %s at load: %.2f GiB held (%s)%s",
                    model_dir, kind, dtype, held / 2**30, missing,
                    f", by each of {group.size} ranks" if group.size > 1 else "")  # fmt: skip
    # The backbone alone, no head stored (before padding counts for it): an embedding
    # checkpoint. A causal LM's files without their head are broken, not that.
    headless = bare and filled.get(_HEAD) == 0
    for name, spec in specs.items():  # a split's padding (the last vocabulary slice's)
        filled[name] += _zero_padding(params[name].data, spec)
    if unexpected:
        raise ModelLoadError(
            f"{model_dir}: unexpected tensors for {arch.architecture}: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = [name for name, count in filled.items() if count != params[name].numel()]
    if headless and missing == [_HEAD]:
        # Qwen3-Embedding-4B's files, say: it serves embeddings; the engine refuses to
        # generate with it.
        logger.info("%s has no lm_head.weight: it serves embeddings only", model_dir)
        model.lm_head = None
        model.generates = False
        missing = []
    if missing and all(name.startswith("model.mtp_layers.") for name in missing):
        raise ModelLoadError(
            f"{model_dir}: engine.speculative_method mtp: config.json declares "
            f"{arch.num_mtp_layers} MTP layer(s) (num_nextn_predict_layers, or Qwen3.5's "
            "mtp_num_hidden_layers), but the files store no complete one "
            f"(model.layers.{arch.num_layers}.*, or mtp.*; missing {len(missing)} tensors, "
            f"such as {missing[0]})"
        )
    if missing:
        raise ModelLoadError(
            f"{model_dir}: tensors missing from the checkpoint: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )
    model.eval()
    return model


def _dequantized_kind(arch: ModelArchConfig) -> tuple[str, str] | None:
    """(what the checkpoint's quantized weights are, the kernels their memory saving
    would need) for the load's log line; None for a checkpoint the loader does not
    dequantize."""
    if arch.fp8_weights is not None:
        return f"FP8 weights ({arch.fp8_weights.method})", "no FP8 matmuls: W8A16"
    if arch.int_weights is not None:
        ints = arch.int_weights
        return f"{ints.bits}-bit {ints.method} weights", "no integer matmul kernels yet"
    if arch.bnb_weights is not None:
        kind = f"bitsandbytes 4-bit {arch.bnb_weights.quant_type} weights"
        return kind, "no 4-bit matmul kernels yet"
    return None


def copy_shard(
    dest: torch.Tensor,  # the rank's parameter (one expert's, for stacked experts)
    tensor: torch.Tensor,  # full rows row_start ..+ len(tensor) of the full parameter
    row_start: int,
    spec: ShardSpec | None,
    rank: int,
) -> int:
    """Copy what this rank keeps of ``tensor`` into ``dest``; the elements written."""
    rows = tensor.shape[0]
    if spec is None or (spec.rank0_only and rank == 0) or spec.slot_experts is not None:
        dest[row_start : row_start + rows].copy_(tensor)
        return tensor.numel()
    if spec.rank0_only:  # a bias the partial sums must add once: rank 0's
        dest[row_start : row_start + rows].zero_()
        return tensor.numel()
    written = 0
    for piece in spec.pieces:
        if spec.dim == 1:  # input columns of a row-parallel weight
            part = tensor[:, piece.full_start : piece.full_start + piece.length]
            local = slice(piece.local_start, piece.local_start + piece.length)
            dest[row_start : row_start + rows, local].copy_(part)
            written += part.numel()
            continue
        first = max(piece.full_start, row_start)  # output rows: the overlap with the piece
        last = min(piece.full_start + piece.length, row_start + rows)
        if first < last:
            part = tensor[first - row_start : last - row_start]
            local_first = piece.local_start + first - piece.full_start
            dest[local_first : local_first + last - first].copy_(part)
            written += part.numel()
    return written


def _zero_padding(dest: torch.Tensor, spec: ShardSpec) -> int:
    """Zero what ``spec``'s pieces leave of ``dest`` along the split; elements zeroed."""
    if spec.rank0_only or spec.slot_experts is not None:
        return 0
    axis = spec.dim + (1 if spec.per_expert else 0)
    covered = sum(piece.length for piece in spec.pieces)
    padding = dest.shape[axis] - covered
    if padding == 0:
        return 0
    with torch.no_grad():
        dest.narrow(axis, covered, padding).zero_()
    return dest.numel() // dest.shape[axis] * padding
