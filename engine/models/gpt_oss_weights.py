"""GPT-OSS's expert tensors, as checkpoints store them, cut into the engine's stacked layout.

The checkpoints store each layer's experts as four stacked tensors in transformers' layout,
input-major with gate and up columns interleaved:

    mlp.experts.gate_up_proj       [E, H, 2I]  (column 2j: gate j, 2j + 1: up j)
    mlp.experts.gate_up_proj_bias  [E, 2I]     (interleaved likewise)
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

and OpenAI's released checkpoints quantize the two weights to MXFP4
(``gate_up_proj_blocks`` [E, 2I, H/32, 16] uint8 with ``gate_up_proj_scales`` [E, 2I, H/32]
uint8; ``down_proj_*`` likewise with rows H): per 32 values one power-of-two scale
(``2^(scale - 127)``) and 4 bits each (an FP4 E2M1 code, two per byte, low nibble first).
The engine keeps experts output-major with gate rows before up rows (``moe.Experts``), so
weights are transposed and de-interleaved here, one expert at a time: dequantizing all
experts of a 120B layer at once would take several GB of scratch. MXFP4 weights are
dequantized to the model dtype at load (exactly: every FP4 value times a power of two fits
bf16), so they run as bf16 experts: memory, not the fused MXFP4 matmul, is what this gives
up.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

# FP4 E2M1 codes 0..15 (sign bit 3).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
MXFP4_BLOCK = 32  # values per scale

EXPERT_TENSOR = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., G, 16] uint8: 32 FP4 codes per group
    scales: torch.Tensor,  # [..., G] uint8: the group's exponent + 127
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., G * 32]
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exponents = scales.to(torch.int32)[..., None] - 127
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)


def expert_pieces(
    prefix: str,  # "model.layers.{i}.mlp.experts"
    which: str,  # "gate_up_proj" or "down_proj"
    suffix: str,  # "", "_bias" or "_blocks"
    tensor: torch.Tensor,
    scales: Callable[[], torch.Tensor] | None,  # the "_scales" partner of "_blocks"
    dtype: torch.dtype,
) -> Iterator[tuple[str, int, int, torch.Tensor]]:
    """(parameter, expert, first row, rows) pieces of one stored tensor."""
    param = f"{prefix}.{which}" + ("_bias" if suffix == "_bias" else "")
    partner = scales() if scales is not None else None
    for expert in range(tensor.shape[0]):
        if suffix == "_blocks":
            assert partner is not None
            rows = dequantize_mxfp4(tensor[expert], partner[expert], dtype)  # output-major
        elif suffix == "_bias":
            rows = tensor[expert]
        else:
            rows = tensor[expert].T  # input-major -> output-major
        if which == "down_proj":
            yield param, expert, 0, rows
        else:  # interleaved gate / up rows -> gate rows, then up rows
            half = rows.shape[0] // 2
            yield param, expert, 0, rows[0::2]
            yield param, expert, half, rows[1::2]
