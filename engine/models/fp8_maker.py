"""Write an FP8 copy of a checkpoint in the layouts real FP8 checkpoints use.

``quantize_checkpoint(src, out, scheme)`` copies ``src`` (config, tokenizer, weights) to
``out`` with every linear projection's weight (attention, MLP, experts; not the
embeddings, the LM head or norms, as released FP8 checkpoints leave them) stored as
float8_e4m3fn with its scale beside it, and the ``quantization_config`` that names the
layout. It is how tests and benchmarks get FP8 checkpoints without downloading one; what
the engine reads back is ``fp8_weights.py``'s business. Schemes (``SCHEMES``):

- ``fp8-block``: transformers' FineGrainedFP8 (Qwen3-*-FP8, and DeepSeek-V3's layout):
  ``weight_scale_inv`` per ``block_size`` block.
- ``fp8-tensor``: AutoFP8's older ``fp8`` checkpoints (Mixtral-8x7B-Instruct-FP8): one 0-d
  ``weight_scale`` per tensor and a static ``input_scale``.
- ``ct-tensor`` / ``ct-channel`` / ``ct-block``: llm-compressor's compressed-tensors
  ``float-quantized`` (RedHatAI's FP8, FP8-dynamic and FP8-block checkpoints):
  ``weight_scale`` per tensor (with a static ``input_scale``), per output row, or per block.
- ``fbgemm``: Meta's fbgemm_fp8 (Llama 3.1 405B FP8): ``weight_scale`` per output row and
  an ``input_scale_ub``.
- ``modelopt``: NVIDIA ModelOpt's FP8 as its older checkpoints store it: 0-d
  ``weight_scale`` and ``input_scale`` per tensor, named in ``hf_quant_config.json``
  (config.json says nothing).

Scales are absmax / 448 (e4m3's largest finite value), so every block's largest weight
lands on 448; values round to nearest even and saturate, as torch's conversion does.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.models.checkpoint_files import safetensors_files
from engine.models.fp8_config import SCHEMES
from engine.models.fp8_weights import expand_block_scales

_PER_TENSOR = ("fp8-tensor", "ct-tensor", "modelopt")
_INDEX = "model.safetensors.index.json"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# The projections released FP8 checkpoints quantize: attention, MLP and experts.
_QUANTIZED = re.compile(r".*_proj\.weight$|.*\.experts\.\d+\.w[123]\.weight$")


def _absmax_scales(
    weight: torch.Tensor,  # [rows, cols]
    block_size: tuple[int, int],  # (rows, cols) per scale
) -> torch.Tensor:  # [ceil(rows / block rows), ceil(cols / block cols)] float32
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    grid = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    padded = torch.nn.functional.pad(
        weight.float().abs(), (0, grid[1] * block_cols - cols, 0, grid[0] * block_rows - rows)
    )
    blocks = padded.reshape(grid[0], block_rows, grid[1], block_cols)
    return (blocks.amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)


def quantize_weight(
    weight: torch.Tensor,  # [rows, cols]
    block_size: tuple[int, int],  # (rows, cols) per scale: (rows, cols) is one per tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight [rows, cols], float32 scales [grid rows, grid cols])."""
    scales = _absmax_scales(weight, block_size)
    expanded = expand_block_scales(scales, block_size, *weight.shape)
    quantized = (weight.float() / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scales


def _ct_config(strategy: str, block_size: tuple[int, int]) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": strategy,
               "block_structure": list(block_size) if strategy == "block" else None}  # fmt: skip
    activations = {"num_bits": 8, "type": "float", "symmetric": True,
                   "dynamic": strategy != "tensor",
                   "strategy": "tensor" if strategy == "tensor" else "token"}  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quantize_checkpoint(
    src: str | Path, out: str | Path, scheme: str, block_size: tuple[int, int] = (128, 128)
) -> Path:
    """``out``: ``src`` with its projections in FP8 under ``scheme`` (``block_size`` for the
    block schemes)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown FP8 scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    src, out = Path(src), Path(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    weight_map: dict[str, str] = {}  # stored name -> file, for a sharded source's index
    for path in safetensors_files(src):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(path).items():
            if not _QUANTIZED.match(name) or tensor.ndim != 2:
                tensors[name] = tensor
                continue
            rows, cols = tensor.shape
            per_tensor = scheme in _PER_TENSOR
            per = (rows, cols) if per_tensor else block_size if "block" in scheme else (1, cols)
            quantized, scales = quantize_weight(tensor, per)
            tensors[name] = quantized
            if scheme == "fp8-block":
                tensors[f"{name}_scale_inv"] = scales
                continue
            prefix = name.removesuffix("weight")
            if per_tensor:  # and a static input scale (unused by the engine)
                shape = (1,) if scheme == "ct-tensor" else ()  # AutoFP8's, ModelOpt's: 0-d
                scales = scales.reshape(shape)
                tensors[f"{prefix}input_scale"] = torch.tensor(0.05).reshape(shape)
            elif scheme == "fbgemm":
                tensors[f"{prefix}input_scale_ub"] = torch.tensor([1200.0])
            tensors[f"{prefix}weight_scale"] = scales
        save_file(tensors, out / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    if (src / _INDEX).exists():  # shards: the scales are new names in the map
        (out / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if scheme == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block_size),
        }
    elif scheme == "modelopt":
        quantization = {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        }
        producer = {"name": "modelopt", "version": "0.19.0"}
        modelopt = {"producer": producer, "quantization": quantization}
        (out / "hf_quant_config.json").write_text(json.dumps(modelopt))
    elif scheme == "fp8-tensor":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    elif scheme == "fbgemm":
        config["quantization_config"] = {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        }
    else:
        config["quantization_config"] = _ct_config(scheme.removeprefix("ct-"), block_size)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
