"""Write a random LoRA adapter for a made (or any Llama-family) checkpoint, in PEFT's format.

MLP targets are skipped on mixture-of-experts layers, which ``lora.py`` does not adapt. On a
Phi-3 base, q/k/v targets adapt its fused ``qkv_proj`` and gate/up its ``gate_up_proj``, the
modules PEFT finds there. On a hybrid base (Qwen3.5) each target adapts the layers that
have it: q/k/v/o the full-attention ones, ``in_proj_*`` / ``out_proj`` the
linear-attention ones (Granite 4.0-H's: ``in_proj`` / ``out_proj`` its Mamba-2 layers,
``input_linear`` / ``output_linear`` its shared MLP; Nemotron-H's: each layer's
``mixer`` that has the target).

The files are what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors``), so ``peft`` loads them too, which is how the tests check
``engine/models/lora.py`` against an independent implementation. Both A and B are random
(a freshly initialised PEFT adapter has B = 0 and changes nothing), scaled so the adapter
changes most greedy continuations while keeping the logits well separated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model_info import LORA_MAKER_TARGETS
from engine.models.arch import read_arch_config
from engine.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, block_of, module_shapes

# Phi-3's module that holds each target (its checkpoints fuse q/k/v and gate/up).
_PHI3_MODULE = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip


def make_lora_adapter(
    model_dir: str | Path,
    out: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = LORA_MAKER_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """Write an adapter for ``model_dir``'s model to ``out`` (created). Returns ``out``."""
    unknown = sorted(set(targets) - set(LORA_MAKER_TARGETS))
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; choose from {LORA_MAKER_TARGETS}")
    arch = read_arch_config(model_dir)
    if arch.architecture == "Phi3ForCausalLM":  # its modules are the fused projections
        targets = list(dict.fromkeys(_PHI3_MODULE.get(t, t) for t in targets))
    shapes = module_shapes(arch)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    # PEFT's names: a multimodal base (Gemma 3 4B+) holds its text layers one level deeper.
    multimodal = arch.architecture == "Gemma3ForConditionalGeneration"
    prefix = "base_model.model.model." + ("language_model.layers" if multimodal else "layers")
    if arch.block_kinds:  # Nemotron-H's layers: ``backbone.layers.{i}.mixer``
        prefix = "base_model.model.backbone.layers"
    for layer in range(arch.num_layers):
        for target in targets:
            block = block_of(target, layer, arch)
            if block is None or (block in ("mlp", "shared_mlp") and arch.is_sparse(layer)):
                continue  # not in this layer, or a mixture-of-experts MLP (lora.py)
            in_features, out_features = shapes[target]
            key = f"{prefix}.{layer}.{block}.{target}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * (0.5 / rank**0.5)
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": _target_modules(targets, tensors, multimodal),
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _target_modules(
    targets: Sequence[str], tensors: dict[str, torch.Tensor], multimodal: bool
) -> list[str] | str:
    """The adapted module names; for a multimodal base, a regex that keeps PEFT off the
    vision tower's projections of the same names."""
    names = [t for t in targets if any(f".{t}." in key for key in tensors)]
    return rf".*language_model.*\.({'|'.join(names)})" if multimodal else names
