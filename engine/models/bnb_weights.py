"""bitsandbytes 4-bit weights dequantized to the model dtype as they are read
(``bnb_config.py`` says what loads and how a weight and its state are stored).

In float32, as bitsandbytes computes them: each nibble's code value times its block's
absmax (the absmax first rebuilt from their 8-bit codes under double quantization), then
cast to the model dtype once. transformers with bitsandbytes on a CPU computes its 4-bit
layers from the same dequantized weights, which is the tests' oracle.
"""

from __future__ import annotations

import json
import math

import torch

from engine.models.errors import ModelLoadError


def dequantize_bnb4(
    packed: torch.Tensor,  # uint8 [ceil(n / 2), 1]: two values a byte, the first high
    state: dict[str, torch.Tensor],  # the suffixes after "weight." -> the stored tensors
    dtype: torch.dtype,
    name: str,
) -> torch.Tensor:  # the weight, of the shape its state names
    """The weight ``packed`` stands for; a ModelLoadError naming ``name`` for a state
    that is missing or does not fit it."""
    header = next((k for k in state if k.startswith("quant_state.bitsandbytes__")), None)
    if header is None or "absmax" not in state or "quant_map" not in state:
        raise ModelLoadError(f"{name}: a bitsandbytes 4-bit weight without its quant_state, "
                             "absmax and quant_map beside it")  # fmt: skip
    meta = json.loads(bytes(state[header].tolist()).decode())
    shape, blocksize = [int(d) for d in meta["shape"]], int(meta["blocksize"])
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != -(-n // 2):
        raise ModelLoadError(f"{name}: {packed.numel()} {packed.dtype} bytes do not hold a "
                             f"{shape} weight at two values a byte")  # fmt: skip
    absmax = state["absmax"]
    if "nested_absmax" in state:  # double quantization: the absmax are 8-bit codes
        codes = state["nested_quant_map"].float()[absmax.long()]
        absmax = _blockwise(codes, state["nested_absmax"].float(), int(meta["nested_blocksize"]))
        absmax = absmax + float(meta["nested_offset"])
    blocks = -(-n // blocksize)
    if absmax.numel() != blocks:
        raise ModelLoadError(f"{name}: {absmax.numel()} absmax for {blocks} blocks of "
                             f"{blocksize} values")  # fmt: skip
    nibbles = torch.stack((packed.reshape(-1) >> 4, packed.reshape(-1) & 0xF), dim=-1)
    values = state["quant_map"].float()[nibbles.reshape(-1).long()][:n]
    return _blockwise(values, absmax.float(), blocksize).reshape(shape).to(dtype)


def _blockwise(values: torch.Tensor, scales: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``values`` [n] times one scale per ``blocksize`` of them (the last block partial)."""
    n = values.numel()
    full = n - n % blocksize
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    out[:full] = (values[:full].view(-1, blocksize) * scales[: full // blocksize, None]).view(-1)
    if full < n:
        out[full:] = values[full:] * scales[full // blocksize]
    return out
