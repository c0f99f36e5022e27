"""Integer weight checkpoints, GPTQ's and AWQ's: which layouts load (read from config.json,
without torch).

Both store each quantized projection ``X`` as small unsigned integers packed into int32
words, with a float scale and an integer zero point per group of ``group_size`` input
columns and output row; a stored value ``q`` stands for ``(q - zero) * scale``:

- ``quant_method: gptq`` (AutoGPTQ, GPTQModel, llm-compressor's GPTQ export; most
  ``*-GPTQ-Int4``/``-Int8`` releases): ``X.qweight`` [in / (32 / bits), out], packed
  along the input (word ``r`` holds rows ``r * 32 / bits ..``, row ``i`` at bits
  ``(i % (32 / bits)) * bits``); ``X.qzeros`` [groups, out / (32 / bits)], packed along
  the output the same way; ``X.scales`` [groups, out]; ``X.g_idx`` [in], each input row's
  group (``desc_act``: act-order, rows quantized by decreasing activation, so groups are
  not contiguous). ``checkpoint_format: gptq`` (v1, the default) stores each zero minus
  one (AutoGPTQ's historic offset); ``gptq_v2`` stores it as it is. 2, 4 and 8 bits.
- ``quant_method: awq``, ``version: gemm`` (AutoAWQ; ``*-AWQ`` releases): ``X.qweight``
  [in, out / 8], eight 4-bit values per word along the output in AWQ's interleaved order
  (word nibble ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight);
  ``X.qzeros`` [groups, out / 8] alike; ``X.scales`` [groups, out]; groups contiguous.
  ``zero_point: false`` stores no zeros (the zero is 8). Its GEMV, Marlin and exllama
  layouts are refused.

The weights are dequantized to the model dtype as they are read (``int_weights.py``), so
the model runs as its dequantized copy would: what it gives up is the memory (a 4-bit
checkpoint takes 4x its bytes in bf16) and integer matmul kernels (Marlin, Machete),
which need a GPU to build and measure. Layers the checkpoint did not quantize (the head,
routers; AWQ's ``modules_to_not_convert``) are stored as floats and load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.models.errors import ModelLoadError

# The stored tensors of one quantized projection, beside its name: the packed values
# (read first; they name the weight) and what is read with them.
PACKED_SUFFIX = ".qweight"
SIDECAR_SUFFIXES = (".qzeros", ".scales", ".g_idx")
_GPTQ_BITS = (2, 4, 8)
_GPTQ_FORMATS = ("gptq", "gptq_v2")
SUPPORTED = "gptq (2/4/8-bit, v1 or v2, act-order), awq (4-bit gemm)"
# The layouts ``int_weights_maker`` writes, by the name ``pdserve make-model --int`` takes:
# scheme -> (quantization_config, symmetric). gptq: v1 (zeros stored minus one), which
# only symmetric weights can use (a zero of 0 would be stored as -1); gptq-v2: as they are.
SCHEMES: dict[str, tuple[dict[str, Any], bool]] = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, True),
    "gptq-act-order": ({"quant_method": "gptq", "bits": 4, "desc_act": True, "sym": True,
                        "checkpoint_format": "gptq"}, True),
    "gptq-v2": ({"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False,
                 "checkpoint_format": "gptq_v2"}, False),
    "gptq-8bit": ({"quant_method": "gptq", "bits": 8, "desc_act": False, "sym": True,
                   "checkpoint_format": "gptq"}, True),
    "awq": ({"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}, False),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class IntWeights:
    """How a checkpoint's packed integer weights read."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # input columns per scale; -1: one group (per output row)
    # Added to each stored zero: 1 for GPTQ's v1 format, else 0.
    zero_offset: int = 0
    # AWQ without zero points: every zero is 2 ** (bits - 1).
    has_zeros: bool = True

    @property
    def per_word(self) -> int:
        return 32 // self.bits


def read_int_weights_config(config: dict[str, Any], path: Any) -> IntWeights | None:
    """The integer layout of a ``quantization_config`` (GPTQ or AWQ); None for another
    method. A ModelLoadError names what is not supported of these two."""
    method = config.get("quant_method")
    if method not in ("gptq", "awq"):
        return None
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group_size, int) or not (group_size > 0 or group_size == -1):
        raise ModelLoadError(f"{path}: {method} group_size must be a positive integer or -1, "
                             f"not {group_size!r}")  # fmt: skip
    if method == "gptq":
        if bits not in _GPTQ_BITS:
            raise ModelLoadError(f"{path}: gptq bits={bits!r} is not supported "
                                 f"({', '.join(map(str, _GPTQ_BITS))} are)")  # fmt: skip
        form = config.get("checkpoint_format") or "gptq"
        if form not in _GPTQ_FORMATS:
            raise ModelLoadError(f"{path}: gptq checkpoint_format {form!r} is not supported "
                                 f"({', '.join(_GPTQ_FORMATS)} are)")  # fmt: skip
        return IntWeights("gptq", bits, group_size, zero_offset=int(form == "gptq"))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ModelLoadError(f"{path}: awq {bits}-bit {version!r} weights are not supported "
                             "(4-bit gemm are)")  # fmt: skip
    return IntWeights("awq", 4, group_size, has_zeros=bool(config.get("zero_point", True)))
