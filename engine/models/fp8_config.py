"""FP8 weight checkpoints: which layouts load (read from config.json, without torch).

Released FP8 checkpoints store each projection's weight as float8 (E4M3) with float
scales beside it; a stored value times its scale is the weight. Four layouts are read:

- ``quant_method: fp8`` (transformers' FineGrainedFP8: Qwen3-*-FP8; DeepSeek-V3's layout):
  ``X.weight`` [rows, cols] and ``X.weight_scale_inv`` [ceil(rows / br), ceil(cols / bc)],
  one scale per ``weight_block_size`` [br, bc] block (the name's "inv" is historic:
  DeepSeek's reference multiplies by it too). Without a block size, ``X.weight_scale``
  holds one scale for the tensor (AutoFP8's older checkpoints). ``scale_fmt: ue8m0``:
  scales may be stored as exponent bytes (2 ** (byte - 127)).
- ``quant_method: compressed-tensors``, ``format: float-quantized`` or ``naive-quantized``
  with 8-bit float weights (llm-compressor's FP8, FP8-dynamic and FP8-block: RedHatAI's and
  neuralmagic's checkpoints): ``X.weight_scale`` per tensor [1], per output row [rows, 1],
  or per ``block_structure`` block. Asymmetric weights, online transforms and sparse
  formats change what the stored weights mean and are refused.
- ``quant_method: fbgemm_fp8`` (Meta's Llama 3.1 405B FP8): ``X.weight_scale`` per row.
- ``quant_method: modelopt``, ``quant_algo: FP8`` (NVIDIA's ModelOpt: nvidia/*-FP8):
  ``X.weight_scale`` per tensor (``FP8_PER_CHANNEL_PER_TOKEN``: per row). Older ModelOpt
  checkpoints say so in ``hf_quant_config.json`` instead of config.json
  (``read_quantization_config``). NVFP4 and ModelOpt's other algorithms are refused.

The weights are dequantized to the model dtype as they are read (``fp8_weights.py``).
The checkpoints' activation scales (``input_scale``, ``input_scale_ub``) are for FP8
matmuls and are not used: activations stay in the model dtype (W8A16, not the W8A8 that
vLLM runs on Hopper, so outputs are the dequantized model's). Calibrated KV-cache scales
(``k_scale``, ``v_scale``, one per layer) are kept on the model, and an FP8 KV cache
(``engine.kv_cache_dtype``) stores K/V over them (``llama.use_kv_scales``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.errors import ModelLoadError
from engine.models.int_weights_config import SUPPORTED as INT_SUPPORTED

# The layouts ``fp8_maker`` writes, by the name ``pdserve make-model --fp8`` takes (here,
# torch-free, so that building the CLI's parser does not import torch).
SCHEMES = ("fp8-block", "fp8-tensor", "ct-tensor", "ct-channel", "ct-block", "fbgemm", "modelopt")
# A stored FP8 tensor's scales: its name plus one of these (``X.weight_scale_inv``, or
# ``X_scale`` beside a stacked experts tensor ``X``).
SCALE_SUFFIXES = ("_scale_inv", "_scale")
# Every tensor FP8 checkpoints store beside their weights: the weights' scales (read with
# them), the KV-cache scales (kept for an FP8 cache) and the activation scales (unused).
SIDECAR_SUFFIXES = (*SCALE_SUFFIXES, "_scale_ub")

_CT_STRATEGIES = ("tensor", "channel", "block")
# compressed-tensors formats that store FP8 weights as they are, with their scales
# (naive-quantized: older neuralmagic releases and weight-only FP8 schemes).
_CT_FORMATS = (None, "float-quantized", "naive-quantized")
# How ``fp8`` checkpoints store scales: float32 values, or (MXFP8's) powers of two as the
# exponent byte (E8M0).
_SCALE_FORMATS = ("float", "ue8m0")
# ModelOpt's FP8 algorithms: one scale per weight tensor, or per row.
_MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
SUPPORTED = ("fp8, fbgemm_fp8, compressed-tensors (float- or naive-quantized, 8-bit float), "
             "modelopt (FP8)")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    """How a checkpoint's FP8 weights are scaled."""

    method: str  # the config's quant_method
    block_size: tuple[int, int] | None = None  # (rows, cols) per scale, if block-scaled
    scale_format: str = "float"  # "ue8m0": uint8 scales are exponents (2 ** (byte - 127))
    # Whether the config declares FP8 KV-cache scales (a checkpoint's k_scale / v_scale
    # mean FP8 scales only then: ModelOpt writes NVFP4 KV scales under the same names).
    fp8_kv_scales: bool = True


def _block_size(value: Any, where: str, path: Any) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ModelLoadError(f"{path}: {where} must be two positive integers, not {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors(config: dict[str, Any], path: Any) -> Fp8Weights:
    """The one FP8 layout every config group of a compressed-tensors config uses."""
    groups = config.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"{path}: compressed-tensors quantization_config has no config_groups")
    # Online transforms (rotations of the activations at run time) and sparse formats
    # change what the weights mean: loading the weights alone would compute wrong values.
    if config.get("transform_config"):
        raise ModelLoadError(f"{path}: compressed-tensors transform_config (online rotations) "
                             "is not supported")  # fmt: skip
    sparsity = (config.get("sparsity_config") or {}).get("format")
    if sparsity not in (None, "dense"):
        raise ModelLoadError(f"{path}: compressed-tensors sparsity format {sparsity!r} is not "
                             "supported (only dense weights)")  # fmt: skip
    blocks: set[tuple[int, int] | None] = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        form = group.get("format") or config.get("format")
        num_bits, kind = weights.get("num_bits"), weights.get("type")
        if num_bits != 8 or kind != "float" or form not in _CT_FORMATS:
            raise ModelLoadError(
                f"{path}: compressed-tensors group {name!r} stores {num_bits}-bit {kind} "
                f"weights ({form}); only FP8 weights (8-bit float, float- or "
                "naive-quantized) load"
            )
        if weights.get("symmetric") is False:
            raise ModelLoadError(f"{path}: compressed-tensors group {name!r}: asymmetric FP8 "
                                 "weights (with zero points) are not supported")  # fmt: skip
        strategy = weights.get("strategy")
        if strategy not in _CT_STRATEGIES:
            raise ModelLoadError(
                f"{path}: compressed-tensors group {name!r}: FP8 weight strategy {strategy!r} "
                f"is not supported ({', '.join(_CT_STRATEGIES)} are)"
            )
        where = f"config_groups.{name}.weights.block_structure"
        blocks.add(_block_size(weights.get("block_structure"), where, path)
                   if strategy == "block" else None)  # fmt: skip
    block_sizes = blocks - {None}
    if len(block_sizes) > 1:
        raise ModelLoadError(f"{path}: config groups use different block sizes {block_sizes}")
    return Fp8Weights("compressed-tensors", next(iter(block_sizes), None),
                      fp8_kv_scales=fp8_kv_cache_declared(config))  # fmt: skip


def fp8_kv_cache_declared(config: dict[str, Any]) -> bool:
    """Whether a ``quantization_config`` says its KV-cache scales are FP8 ones, whatever
    its weights: compressed-tensors' 8-bit float ``kv_cache_scheme``, ModelOpt's FP8
    ``kv_cache_quant_algo``. (An integer-weight checkpoint may carry them: they were
    refused as unexpected tensors.)"""
    kv = config.get("kv_cache_scheme")
    if isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float":
        return True
    return config.get("kv_cache_quant_algo") == "FP8"


def kv_cache_only(config: dict[str, Any]) -> bool:
    """A compressed-tensors config that quantizes the KV cache alone (no config groups,
    as compressed-tensors writes such a scheme): the weights are not quantized."""
    compressed = config.get("quant_method") == "compressed-tensors"
    return compressed and not config.get("config_groups") and bool(config.get("kv_cache_scheme"))


def read_fp8_config(config: dict[str, Any], path: Any) -> Fp8Weights:
    """The FP8 layout of a ``quantization_config``; a ModelLoadError naming what is not
    supported for any other quantization."""
    method = config.get("quant_method", "?")
    if method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"{path}: fp8 weights in format {config['fmt']!r} (only e4m3)")
        scale_format = config.get("scale_fmt") or "float"
        if scale_format not in _SCALE_FORMATS:
            raise ModelLoadError(f"{path}: fp8 scale_fmt {scale_format!r} is not supported "
                                 f"({', '.join(_SCALE_FORMATS)} are)")  # fmt: skip
        block = config.get("weight_block_size")
        block_size = None if block is None else _block_size(block, "weight_block_size", path)
        return Fp8Weights("fp8", block_size, scale_format)
    if method == "fbgemm_fp8":
        return Fp8Weights("fbgemm_fp8")
    if method == "compressed-tensors":
        return _compressed_tensors(config, path)
    if method == "modelopt":
        algorithm = config.get("quant_algo")
        if algorithm not in _MODELOPT_FP8:
            raise ModelLoadError(f"{path}: modelopt quant_algo {algorithm!r} is not supported "
                                 f"({', '.join(_MODELOPT_FP8)} are)")  # fmt: skip
        return Fp8Weights("modelopt", fp8_kv_scales=fp8_kv_cache_declared(config))
    raise ModelLoadError(
        f"{path}: quantized checkpoints ({method}) are not supported; weight quantizations "
        f"that load: {SUPPORTED}, {INT_SUPPORTED}, bitsandbytes (4-bit nf4 or fp4), and GPT-OSS's "
        "mxfp4"
    )


def read_quantization_config(
    raw: dict[str, Any], text: dict[str, Any], model_dir: Path
) -> dict[str, Any] | None:
    """A checkpoint's ``quantization_config``: config.json's (``raw``), else its
    ``text_config``'s (``text``: compressed-tensors may put it there in a multimodal
    checkpoint), else ModelOpt's ``hf_quant_config.json`` beside it; None: not quantized."""
    found = raw.get("quantization_config") or text.get("quantization_config")
    if found:
        return found
    modelopt = model_dir / "hf_quant_config.json"
    if not modelopt.is_file():
        return None
    quantization = json.loads(modelopt.read_text()).get("quantization") or {}
    return {"quant_method": "modelopt", **quantization}
