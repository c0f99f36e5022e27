"""LoRA adapters in PEFT's format, applied per token so that one step mixes adapters.

An adapter adds ``scale * B @ A`` to some of a layer's projections; here it is never merged
into the base weights. Each step, the rows of the flat batch that belong to requests of one
adapter get ``(x @ A^T) @ B^T`` added to the projection's output (``LoraBatch.apply``), so
requests of several adapters and of the base model share one forward pass and one KV cache
(the cache is keyed by adapter: ``common.hashing.prefix_salt``). The cost is two thin
matmuls per adapted projection and adapter present in the step; a step without adapter
requests runs exactly the base model.

Files (what ``PeftModel.save_pretrained`` writes): ``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.model.layers.{i}.{self_attn|mlp}.
{q|k|v|o|gate|up|down}_proj.lora_{A|B}.weight`` (Phi-3's: ``qkv_proj`` and ``gate_up_proj``,
the fused projections its checkpoints have; a multimodal base's language model:
``...model.language_model.layers...``); A is ``[rank, in]``, B ``[out, rank]``.
The scale is ``lora_alpha / rank`` (``lora_alpha / sqrt(rank)`` with ``use_rslora``).
q/k/v (and gate/up) are fused projections here (``llama.py``): their A's are stacked along
the rank and their B's placed block-diagonally, so each fused projection takes one pair.
A hybrid model's (Qwen3.5's) linear-attention layers take adapters of
``linear_attn.{in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj}``: the four input
projections are one fused ``in_proj`` here (``gated_delta_net.py``), stacked as q/k/v are;
its full-attention layers' q_proj rows hold each head's query and output gate.
Granite 4.0-H's take ``mamba.{in_proj|out_proj}`` (whole: one projection in the
checkpoint as here, ``mamba2.py``) and its shared MLP's ``shared_mlp.{input_linear|
output_linear}`` (gate and up rows in one projection, as ``gate_up_proj`` here; the
shared MLP alone, as in its Micro model: beside experts it is their shared expert).
Bamba's: Granite's Mamba-2 and attention names, its MLP's ``feed_forward.{gate|up|down}_proj``.
Nemotron-H's layers are each one block, which PEFT names ``backbone.layers.{i}.mixer``:
its Mamba-2 layers' ``in_proj`` / ``out_proj``, its attention's ``q|k|v|o_proj``, its
ungated MLPs' ``up_proj`` (a projection of its own here, not half of a ``gate_up_proj``)
and ``down_proj``.
What this does not implement is refused at load with the reason: DoRA, adapted embeddings
or LM head (``modules_to_save`` and ``embed_tokens``/``lm_head`` targets), LoRA biases and
per-module alphas (``alpha_pattern``), the MLP of mixture-of-experts layers (its
experts and shared expert; attention projections there are adapted as anywhere), and
models with latent attention (MLA).

Under tensor parallelism a rank's adapter is cut like its base weights
(``engine.parallel.shard_spec``): a column-parallel projection (q/k/v, gate/up) keeps the
B rows of its output rows and all of A; a row-parallel one (o, down) keeps the A columns
of its input slice and all of B, so its delta is a partial sum like its base output and
the layer's all-reduce adds both up.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from common.hashing import lora_key
from common.model_info import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from engine.models.arch import ModelArchConfig, ModelLoadError
from engine.models.arch_parts import LinearAttentionConfig
from engine.models.fingerprint import adapter_fingerprint
from engine.parallel.shard_spec import TensorParallel, shard_spec

logger = logging.getLogger(__name__)

# A multimodal base (Gemma 3 4B+) puts its language model's layers under
# ``model.language_model.`` (transformers 5) or ``language_model.model.`` (4).
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.|model\.language_model\.|language_model\.model\.|backbone\.)"
    r"layers\.(\d+)\.(self_attn|mlp|linear_attn|mamba|shared_mlp|mixer|feed_forward)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj"
    r"|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|in_proj|out_proj|input_linear|output_linear)"
    r"\.lora_(A|B)\.weight$"
)
# The block each module lives in: attention and MLP ones, or a linear-attention layer's.
_LINEAR_MODULES = frozenset(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))
_MLP_MODULES = frozenset(("gate_proj", "up_proj", "down_proj", "gate_up_proj"))
# Granite 4.0-H's: its Mamba-2 layers' and its shared MLP's.
_MAMBA_MODULES = frozenset(("in_proj", "out_proj"))
_SHARED_MLP_MODULES = frozenset(("input_linear", "output_linear"))
# A multimodal base's vision tower and projector (transformers 5's and 4's paths; Qwen's
# is ``visual``).
_VISION = re.compile(
    r"^base_model\.model\.(?:model\.)?(?:vision_tower|multi_modal_projector|visual)\."
)
# Each fused projection here and the adapted modules whose rows it stacks (in order);
# modules that are a whole fused projection apply whole (``_WHOLE``: Phi-3's fused
# qkv_proj / gate_up_proj, Granite 4.0-H's in_proj and its shared MLP's).
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "out_proj": ("out_proj",),
}  # fmt: skip
_WHOLE = {"qkv_proj": "qkv_proj", "gate_up_proj": "gate_up_proj", "in_proj": "in_proj",
          "input_linear": "gate_up_proj", "output_linear": "down_proj"}  # fmt: skip
# Nemotron-H's: its MLPs are ungated (up_proj is a projection of its own), and the
# modules each kind of its one-block layers has.
_UNGATED_PARTS = {k: v for k, v in _FUSED_PARTS.items() if k != "gate_up_proj"} | {
    "up_proj": ("up_proj",)
}
_NEMOTRON_MODULES = {
    "mamba": frozenset(("in_proj", "out_proj")),
    "attention": frozenset(("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp": frozenset(("up_proj", "down_proj")),
}
_TARGETS = frozenset(m for parts in _FUSED_PARTS.values() for m in parts) | _WHOLE.keys()


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One adapted (fused) projection: its output gains ``(x @ a.T) @ b.T``."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank], the adapter's scale folded in


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class LoraAdapter:
    """One loaded adapter. Requests hold it from admission to their end, so an adapter
    unloaded meanwhile stays valid for them (``LLMEngine.unload_lora_adapter``)."""

    name: str
    fingerprint: str  # of its files (engine/models/fingerprint.py)
    # Per layer: fused projection name ("qkv_proj", "o_proj", "gate_up_proj",
    # "down_proj"; a linear-attention layer's "in_proj", "out_proj") -> its pair; a
    # projection the adapter leaves alone is absent.
    layers: tuple[dict[str, LoraPair], ...]
    path: str = ""  # the directory it was read from (the other ranks read it too)
    # Tensors of a multimodal base's vision tower the adapter has (PEFT's plain target
    # names wrap the tower's projections too), left out: images under it would be
    # encoded by the base tower, not PEFT's, so requests with images are refused.
    vision_tensors_skipped: int = 0

    @property
    def key(self) -> str:
        """What its KV is keyed by (``common.hashing.lora_key``): name and weights."""
        return lora_key(self.name, self.fingerprint)


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable module, by its name in the
    checkpoint ("q_proj", ...; a hybrid model's linear-attention ones too)."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q_rows = arch.q_size * (2 if arch.attention_output_gate else 1)  # Qwen3.5: query, gate
    shapes = {
        "q_proj": (hidden, q_rows), "k_proj": (hidden, arch.kv_size),
        "v_proj": (hidden, arch.kv_size), "o_proj": (arch.q_size, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        "qkv_proj": (hidden, q_rows + 2 * arch.kv_size), "gate_up_proj": (hidden, 2 * inter),
    }  # fmt: skip
    linear = arch.linear_attention
    if isinstance(linear, LinearAttentionConfig):
        widths = dict(zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                          linear.in_proj_widths, strict=True))  # fmt: skip
        shapes |= {name: (hidden, width) for name, width in widths.items()}
        shapes["out_proj"] = (linear.value_dim, hidden)
    mamba = arch.mamba2
    if mamba is not None:
        shapes["in_proj"] = (hidden, sum(mamba.in_proj_widths))
        shapes["out_proj"] = (mamba.intermediate_size, hidden)
        shapes["input_linear"] = shapes["gate_up_proj"]
        shapes["output_linear"] = shapes["down_proj"]
    return shapes


def block_of(module: str, layer: int, arch: ModelArchConfig) -> str | None:
    """The block of layer ``layer`` that holds ``module``; None if the layer has none (a
    hybrid model's linear-attention layers have no q_proj, its others no in_proj_z)."""
    if arch.block_kinds:  # Nemotron-H: each layer one block, its ``mixer``
        kind = arch.block_kinds[layer] if layer < len(arch.block_kinds) else ""
        return "mixer" if module in _NEMOTRON_MODULES.get(kind, ()) else None
    if arch.mamba2 is not None:  # Granite 4.0-H's names (Bamba's MLP: ``feed_forward``)
        bamba = arch.architecture == "BambaForCausalLM"
        if module in _SHARED_MLP_MODULES:
            return None if bamba else "shared_mlp"
        if bamba and module in _MLP_MODULES - {"gate_up_proj"}:
            return "feed_forward"
        if module in _MAMBA_MODULES:
            return "mamba" if arch.is_linear(layer) else None
        if module in _MLP_MODULES | _LINEAR_MODULES:
            return None
    elif module in _SHARED_MLP_MODULES or module == "in_proj":
        return None
    if module in _MLP_MODULES:
        return "mlp"
    if module in _LINEAR_MODULES:
        if module != "out_proj" and arch.architecture == "Qwen3NextForCausalLM":
            return None  # its layers have in_proj_qkvz / in_proj_ba, Qwen3.5's names not
        return "linear_attn" if arch.is_linear(layer) else None
    return None if arch.is_linear(layer) else "self_attn"


def _read_config(path: Path) -> dict:
    config_path = path / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no {ADAPTER_CONFIG} (a PEFT LoRA adapter directory)")
    config = json.loads(config_path.read_text())
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "lora_bias": bool(config.get("lora_bias")),
    }
    for key, bad in refused.items():
        if bad:
            raise ModelLoadError(f"{path}: {key}={config.get(key)!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex over module names: checked by the keys instead
        targets = []
    # PEFT matches a target by suffix: a module's full path adapts that module only.
    unknown = sorted({target.rsplit(".", 1)[-1] for target in targets} - _TARGETS)
    if unknown:
        raise ModelLoadError(
            f"{path}: target_modules {unknown} are not supported (only the attention, "
            f"linear-attention, Mamba-2 and MLP projections: {', '.join(sorted(_TARGETS))})"
        )
    return config


def load_lora_adapter(
    name: str,
    path: str | Path,
    arch: ModelArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
) -> LoraAdapter:
    """Read a PEFT adapter for a model of ``arch`` (the full model's), cut for rank
    ``tp.rank`` of a tensor-parallel group; every mismatch is a ``ModelLoadError``."""
    path = Path(path)
    if arch.mla is not None:
        raise ModelLoadError(f"{path}: LoRA adapters on models with latent attention "
                             f"({arch.architecture}) are not supported")  # fmt: skip
    config = _read_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ModelLoadError(f"{path}: no {ADAPTER_WEIGHTS} (only safetensors adapters load)")
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    # PEFT scales by the configured rank, so a config that disagrees with the tensors
    # would be served with another scale than PEFT's (or none, with r=0); with a
    # rank_pattern the ranks differ per module and are read from the tensors.
    declared_rank = None if config.get("rank_pattern") else config.get("r")
    shapes = module_shapes(arch)
    # (layer, module) -> {"A": tensor, "B": tensor}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    skipped = 0  # a multimodal base's vision-side tensors
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _KEY.match(key)
            if match is None and _VISION.match(key):
                # PEFT's plain target names (q_proj, ...) also wrap the vision tower's
                # projections; serving text never runs them, so this is PEFT's model.
                skipped += 1
                continue
            if match is None:
                experts = ".experts." in key or ".shared_expert" in key
                raise ModelLoadError(
                    f"{weights}: unsupported tensor {key}"
                    + (" (LoRA on mixture-of-experts MLPs is not supported)" if experts else "")
                )
            layer, block, module, which = match.groups()
            layer = int(layer)
            if layer >= arch.num_layers:
                raise ModelLoadError(f"{weights}: {key} names layer {layer} of {arch.num_layers}")
            if block != block_of(module, layer, arch):
                kind = "linear-attention" if arch.is_linear(layer) else "full-attention"
                if arch.block_kinds:
                    kind = arch.block_kinds[layer]
                raise ModelLoadError(f"{weights}: {key}: layer {layer} ({kind}) has no "
                                     f"{block}.{module}")  # fmt: skip
            if module in _MLP_MODULES | _SHARED_MLP_MODULES and arch.is_sparse(layer):
                raise ModelLoadError(
                    f"{weights}: {key}: layer {layer} is a mixture-of-experts layer; LoRA on "
                    "its MLP (experts and shared expert) is not supported (adapt the "
                    "attention projections there)"
                )
            found.setdefault((layer, module), {})[which] = f.get_tensor(key)
    if skipped:
        logger.warning(
            "%s: %d vision-tower tensors left out: the adapter serves text prompts; "
            "prompts with images under it are refused (its tower is not applied)",
            weights, skipped,
        )  # fmt: skip
    if not found:
        raise ModelLoadError(f"{weights}: no LoRA tensors")
    per_module: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ModelLoadError(f"{weights}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[module]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ModelLoadError(
                f"{weights}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; this model needs [r, {in_features}] and [{out_features}, r]"
            )
        if declared_rank is not None and rank != declared_rank:
            raise ModelLoadError(
                f"{weights}: layer {layer} {module} has rank {rank}; {ADAPTER_CONFIG} "
                f"says r={declared_rank} (and no rank_pattern)"
            )
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        per_module[(layer, module)] = (a.float(), b.float() * scale)
    layers: list[dict[str, LoraPair]] = [{} for _ in range(arch.num_layers)]
    fused_parts = _UNGATED_PARTS if arch.block_kinds else _FUSED_PARTS
    for layer in range(arch.num_layers):
        for fused, parts in fused_parts.items():
            present = [(m, per_module.get((layer, m))) for m in parts]
            wholes = [per_module[layer, m] for m, f in _WHOLE.items()
                      if f == fused and (layer, m) in per_module]  # fmt: skip
            if wholes:  # an adapter of the fused projection (Phi-3's, Granite's)
                if any(pair is not None for _, pair in present) or len(wholes) > 1:
                    raise ModelLoadError(
                        f"{weights}: layer {layer} adapts {fused} and its parts "
                        f"({', '.join(parts)}) both"
                    )
                a, b = wholes[0]
                layers[layer][fused] = LoraPair(a=a.to(device, dtype), b=b.to(device, dtype))
                continue
            if all(pair is None for _, pair in present):
                continue
            a_rows, b_blocks = [], []
            total_rank = sum(pair[0].shape[0] for _, pair in present if pair is not None)
            offset = 0
            for module, pair in present:
                out_features = shapes[module][1]
                block = torch.zeros(out_features, total_rank)
                if pair is not None:
                    a, b = pair
                    a_rows.append(a)
                    block[:, offset : offset + a.shape[0]] = b
                    offset += a.shape[0]
                b_blocks.append(block)
            layers[layer][fused] = LoraPair(
                a=torch.cat(a_rows).to(device, dtype),  # [total_rank, in]
                b=torch.cat(b_blocks).to(device, dtype),  # [fused out, total_rank]
            )
    if tp is not None and tp.size > 1:
        layers = [
            {proj: _shard_pair(pair, layer, proj, arch, tp) for proj, pair in pairs.items()}
            for layer, pairs in enumerate(layers)
        ]
    return LoraAdapter(
        name=name, fingerprint=adapter_fingerprint(path), layers=tuple(layers), path=str(path),
        vision_tensors_skipped=skipped,
    )  # fmt: skip


# The engine's module holding each fused projection (its weights' names).
_MODULE_OF = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
              "up_proj": "mlp", "down_proj": "mlp", "in_proj": "linear_attn",
              "out_proj": "linear_attn"}  # fmt: skip


def _shard_pair(
    pair: LoraPair, layer: int, projection: str, arch: ModelArchConfig, tp: TensorParallel
) -> LoraPair:
    """Rank ``tp.rank``'s part of one projection's pair, cut as its base weight is."""
    module = _MODULE_OF[projection]
    if arch.mamba2 is not None and module == "linear_attn":
        module = "mamba"
    spec = shard_spec(f"model.layers.{layer}.{module}.{projection}.weight", arch, tp)
    assert spec is not None and not spec.rank0_only
    if spec.dim == 0:  # column-parallel: this rank's output rows of B
        rows = [pair.b[p.full_start : p.full_start + p.length] for p in spec.pieces]
        return LoraPair(a=pair.a, b=torch.cat(rows).contiguous())
    columns = [pair.a[:, p.full_start : p.full_start + p.length] for p in spec.pieces]
    return LoraPair(a=torch.cat(columns, dim=1).contiguous(), b=pair.b)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """Which rows of one step's flat batch use which adapter (rows of no adapter: none)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor], ...]  # (adapter, row indices [n] int64)

    def apply(
        self,
        layer_idx: int,
        projection: str,
        x: torch.Tensor,  # [num_tokens, in_features], the projection's input
        out: torch.Tensor,  # [num_tokens, out_features], its base output; updated in place
    ) -> torch.Tensor:
        for adapter, rows in self.groups:
            pair = adapter.layers[layer_idx].get(projection)
            if pair is not None:
                out.index_add_(0, rows, (x.index_select(0, rows) @ pair.a.T) @ pair.b.T)
        return out
