"""bitsandbytes 4-bit checkpoints (``quant_method: bitsandbytes``, ``load_in_4bit``: the
``*-bnb-4bit`` releases, QLoRA's base models): which load (read from config.json, without
torch).

transformers saves each quantized projection ``X`` as ``X.weight``, uint8 [ceil(n / 2), 1]
(n = out * in values, two per byte, the first in the high nibble), with its quantization
state beside it: ``X.weight.quant_map`` (the 16 values a nibble stands for: NF4's or FP4's
code), ``X.weight.absmax`` (one scale per ``blocksize`` values, in order), and
``X.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``): JSON bytes with the weight's
``shape`` and ``blocksize``. With double quantization (``bnb_4bit_use_double_quant``) the
absmax are themselves 8-bit codes: ``nested_quant_map[code]`` times
``X.weight.nested_absmax`` per ``nested_blocksize`` of them, plus ``nested_offset``.
A value is ``quant_map[nibble] * absmax[its block]``, computed in float32
(``bnb_weights.py``). LLM.int8() checkpoints (``load_in_8bit``) are refused: that method
quantizes activations at run time too, so its dequantized weights would not compute what
it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.errors import ModelLoadError

# Stored beside ``X.weight``: read with it, never loaded as parameters.
SIDECAR_SUFFIXES = (".weight.absmax", ".weight.quant_map", ".weight.nested_absmax",
                    ".weight.nested_quant_map", ".weight.quant_state.bitsandbytes__nf4",
                    ".weight.quant_state.bitsandbytes__fp4")  # fmt: skip
_QUANT_TYPES = ("nf4", "fp4")


@dataclass(frozen=True, slots=True)
class Bnb4Bit:
    """A bitsandbytes 4-bit checkpoint's kind (each weight's own state says the rest)."""

    quant_type: str  # "nf4" or "fp4"
    double_quant: bool


def read_bnb_config(config: dict[str, Any], path: Any) -> Bnb4Bit | None:
    """The 4-bit layout of a ``quantization_config``; None for another method. A
    ModelLoadError names a bitsandbytes checkpoint that does not load."""
    if config.get("quant_method") != "bitsandbytes":
        return None
    if config.get("load_in_8bit") or config.get("_load_in_8bit"):
        raise ModelLoadError(f"{path}: bitsandbytes 8-bit (LLM.int8()) checkpoints are not "
                             "supported: the method quantizes activations at run time")  # fmt: skip
    if not (config.get("load_in_4bit") or config.get("_load_in_4bit")):
        raise ModelLoadError(f"{path}: a bitsandbytes quantization_config that loads neither "
                             "4-bit nor 8-bit weights")  # fmt: skip
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in _QUANT_TYPES:
        raise ModelLoadError(f"{path}: bitsandbytes bnb_4bit_quant_type {quant_type!r} is not "
                             f"supported ({', '.join(_QUANT_TYPES)} are)")  # fmt: skip
    storage = config.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        raise ModelLoadError(f"{path}: bitsandbytes bnb_4bit_quant_storage {storage!r} is not "
                             "supported (uint8 is)")  # fmt: skip
    return Bnb4Bit(quant_type, bool(config.get("bnb_4bit_use_double_quant", False)))
