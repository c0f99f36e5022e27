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
- ``quant_method: compressed-tensors``, ``format: pack-quantized`` with integer weights
  (llm-compressor's W4A16 / W8A16: RedHatAI's ``*-quantized.w4a16``): ``X.weight_packed``
  [out, ceil(in / (32 / bits))], packed along the input as GPTQ's are (padded at the end;
  ``X.weight_shape`` holds [out, in]), each value stored plus ``2 ** (bits - 1)``;
  ``X.weight_scale`` [out, groups] (``strategy: channel``: [out, 1]); asymmetric groups
  add ``X.weight_zero_point`` [ceil(out / (32 / bits)), groups], packed along the output,
  offset alike; ``X.weight_g_idx`` [in] with ``actorder: group``. Every config group
  must use one layout; their ``ignore``d modules are stored as floats.

The weights are dequantized to the model dtype as they are read (``int_weights.py``), so
the model runs as its dequantized copy would: what it gives up is the memory (a 4-bit
checkpoint takes 4x its bytes in bf16) and integer matmul kernels (Marlin, Machete),
which need a GPU to build and measure. Layers the checkpoint did not quantize (the head,
routers; AWQ's ``modules_to_not_convert``) are stored as floats and load as they are.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from engine.models.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackedNames:
    """The suffixes of one quantized projection's stored tensors: the packed values (read
    first; they name the weight) and what is read with them."""

    packed: str
    zeros: str
    scales: str
    g_idx: str
    shape: str | None = None  # the unpadded [out, in], where words may pad the input

    @property
    def sidecars(self) -> tuple[str, ...]:
        return tuple(s for s in (self.zeros, self.scales, self.g_idx, self.shape) if s)


GPTQ_NAMES = PackedNames(".qweight", ".qzeros", ".scales", ".g_idx")  # AWQ's too
CT_NAMES = PackedNames(".weight_packed", ".weight_zero_point", ".weight_scale",
                       ".weight_g_idx", ".weight_shape")  # fmt: skip
_GPTQ_BITS = (2, 4, 8)
_GPTQ_FORMATS = ("gptq", "gptq_v2")
_CT_BITS = (4, 8)
SUPPORTED = ("gptq (2/4/8-bit, v1 or v2, act-order), awq (4-bit gemm), compressed-tensors "
             "pack-quantized (4/8-bit int)")  # fmt: skip


def _ct_config(bits: int, symmetric: bool, strategy: str, actorder: str | None = None) -> dict:
    """A compressed-tensors ``pack-quantized`` config of one group (the maker's)."""
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": 32 if strategy == "group" else None, "actorder": actorder}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}  # fmt: skip


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
    # GPTQModel's per-module rules: layer 1 in 8 bits and groups of 64, layer 3's MLP
    # left unquantized, the rest 4-bit.
    "gptq-dynamic": ({"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": True,
                      "checkpoint_format": "gptq",
                      "dynamic": {r"+:model\.layers\.1\..*": {"bits": 8, "group_size": 64},
                                  r"-:model\.layers\.3\.mlp\..*": {}}}, True),
    "awq": ({"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}, False),
    "ct-w4a16": (_ct_config(4, True, "group"), True),
    "ct-w4a16-asym-act-order": (_ct_config(4, False, "group", "group"), False),
    "ct-w8a16-channel": (_ct_config(8, True, "channel"), True),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class IntWeights:
    """How a checkpoint's packed integer weights read."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int  # input columns per scale; -1: one group (per output row)
    # Added to each stored zero: 1 for GPTQ's v1 format, else 0.
    zero_offset: int = 0
    # No zero points stored (AWQ's zero_point false, symmetric compressed-tensors): every
    # zero is 2 ** (bits - 1).
    has_zeros: bool = True
    # GPTQModel's ``dynamic``: (pattern, bits, group_size) per rule, in order; the first
    # whose pattern matches a module's name from its start decides: bits 0 for a "-:" rule
    # (the module is not quantized), else its bits and group size (the global ones where
    # the rule names none).
    dynamic: tuple[tuple[str, int, int], ...] = ()

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def for_module(self, name: str) -> IntWeights | None:
        """The layout of module ``name`` (``model.layers.1.mlp.down_proj``); None if a
        ``dynamic`` rule leaves it unquantized."""
        for pattern, bits, group_size in self.dynamic:
            if re.match(pattern, name):
                if not bits:
                    return None
                return dataclasses.replace(self, bits=bits, group_size=group_size, dynamic=())
        return self

    @property
    def names(self) -> PackedNames:
        return CT_NAMES if self.method == "compressed-tensors" else GPTQ_NAMES


def read_int_weights_config(config: dict[str, Any], path: Any) -> IntWeights | None:
    """The integer layout of a ``quantization_config`` (GPTQ, AWQ, compressed-tensors'
    packed integers); None for another. A ModelLoadError names what is not supported of
    these."""
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config, path)
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
        if config.get("is_marlin_format"):  # AutoGPTQ's older way of saying it
            form = "marlin"
        if form not in _GPTQ_FORMATS:
            raise ModelLoadError(f"{path}: gptq checkpoint_format {form!r} is not supported "
                                 f"({', '.join(_GPTQ_FORMATS)} are)")  # fmt: skip
        dynamic = _gptq_dynamic(config.get("dynamic") or {}, bits, group_size, path)
        return IntWeights("gptq", bits, group_size, zero_offset=int(form == "gptq"),
                          dynamic=dynamic)  # fmt: skip
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ModelLoadError(f"{path}: awq {bits}-bit {version!r} weights are not supported "
                             "(4-bit gemm are)")  # fmt: skip
    return IntWeights("awq", 4, group_size, has_zeros=bool(config.get("zero_point", True)))


def _compressed_tensors(config: dict[str, Any], path: Any) -> IntWeights | None:
    """The one packed-integer layout every config group uses; None for FP8 groups (read by
    ``fp8_config``)."""
    groups = config.get("config_groups") or {}
    weights = [(name, group.get("weights") or {}) for name, group in groups.items()]
    if not weights or any(w.get("type") != "int" for _, w in weights):
        return None  # FP8 (float weights), or refused there
    layouts = set()
    for name, w in weights:
        form = groups[name].get("format") or config.get("format")
        if form != "pack-quantized":
            raise ModelLoadError(f"{path}: compressed-tensors group {name!r} stores integer "
                                 f"weights as {form!r}; only pack-quantized ones load")  # fmt: skip
        if groups[name].get("input_activations"):
            raise ModelLoadError(f"{path}: compressed-tensors group {name!r} quantizes "
                                 "activations too (W8A8 / W4A8): not supported")  # fmt: skip
        bits, strategy = w.get("num_bits"), w.get("strategy")
        if bits not in _CT_BITS or strategy not in ("group", "channel"):
            raise ModelLoadError(f"{path}: compressed-tensors group {name!r}: {bits}-bit "
                                 f"{strategy} weights are not supported (4 or 8 bits, group "
                                 "or channel)")  # fmt: skip
        group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
        layouts.add((bits, group_size, bool(w.get("symmetric", True))))
    if len(layouts) > 1:
        raise ModelLoadError(f"{path}: compressed-tensors config groups use different "
                             f"layouts {sorted(layouts)}")  # fmt: skip
    bits, group_size, symmetric = layouts.pop()
    return IntWeights("compressed-tensors", bits, group_size, has_zeros=not symmetric)


def _gptq_dynamic(
    rules: dict[str, Any], bits: int, group_size: int, path: Any
) -> tuple[tuple[str, int, int], ...]:
    """GPTQModel's ``dynamic`` rules, in their order (``IntWeights.dynamic``); a bad
    pattern, or a rule's unsupported bits or group size, is a ModelLoadError naming it."""
    parsed = []
    for key, overrides in rules.items():
        pattern = key.removeprefix("-:").removeprefix("+:")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ModelLoadError(f"{path}: gptq dynamic rule {key!r}: {exc}") from None
        if key.startswith("-:"):
            parsed.append((pattern, 0, 0))
            continue
        rule_bits = (overrides or {}).get("bits", bits)
        rule_group = (overrides or {}).get("group_size", group_size)
        if rule_bits not in _GPTQ_BITS or not (
            isinstance(rule_group, int) and (rule_group > 0 or rule_group == -1)
        ):
            raise ModelLoadError(f"{path}: gptq dynamic rule {key!r}: bits={rule_bits!r}, "
                                 f"group_size={rule_group!r} are not supported")  # fmt: skip
        parsed.append((pattern, int(rule_bits), int(rule_group)))
    return tuple(parsed)
