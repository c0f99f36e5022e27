"""FP8 weights dequantized to the model dtype as they are read (``fp8_config.py`` says
which layouts load and how they are scaled).

Each stored value is multiplied by its scale in float32 and cast to the model dtype once,
so an FP8 checkpoint runs exactly as the same model stored at the model dtype would: what
it gives up is the memory (bf16 weights take twice the bytes) and FP8 matmuls (Hopper's
``torch._scaled_mm``), which need a GPU to build and measure. transformers reads these
checkpoints the same way on a machine without FP8 matmuls (dequantized weights,
activations unquantized), which is the tests' oracle.
"""

from __future__ import annotations

import math

import torch

from engine.models.errors import ModelLoadError

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# A stored FP8 tensor's scales: its name plus one of these (``X.weight_scale_inv``, or
# ``X_scale`` beside a stacked experts tensor ``X``).
SCALE_SUFFIXES = ("_scale_inv", "_scale")
# What else FP8 checkpoints store beside their weights, all unused (fp8_config.py).
SIDECAR_SUFFIXES = (*SCALE_SUFFIXES, "_scale_ub")
# Calibrated KV-cache scales (llm-compressor's; older files: the k/v projections' output).
KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "k_proj.output_scale", "v_proj.output_scale")


def dequantize_fp8(
    weight: torch.Tensor,  # [..., rows, cols] float8; leading dims: stacked experts
    scale: torch.Tensor,  # [1] or [] | [..., rows, 1] or [..., rows] | [..., grid rows, grid cols]
    block_size: tuple[int, int] | None,
    dtype: torch.dtype,
    name: str,
) -> torch.Tensor:  # [..., rows, cols] in dtype
    """``weight`` times its scale (per tensor, per row or per block), in ``dtype``."""
    rows, cols = weight.shape[-2:]
    lead = tuple(weight.shape[:-2])
    values, scales = weight.to(torch.float32), scale.to(torch.float32)  # values: scaled in place
    if scales.numel() == 1:
        return values.mul_(scales.reshape(())).to(dtype)
    grid = None if block_size is None else (math.ceil(rows / block_size[0]),
                                            math.ceil(cols / block_size[1]))  # fmt: skip
    shape = tuple(scales.shape)
    if grid is not None and shape == (*lead, *grid):
        assert block_size is not None
        if rows % block_size[0] == 0 and cols % block_size[1] == 0:  # one pass, no copy
            blocks = values.view(*lead, grid[0], block_size[0], grid[1], block_size[1])
            blocks.mul_(scales[..., :, None, :, None])
            return values.to(dtype)
        expanded = scales.repeat_interleave(block_size[0], -2)[..., :rows, :]
        expanded = expanded.repeat_interleave(block_size[1], -1)[..., :cols]
        return values.mul_(expanded).to(dtype)
    if shape in ((*lead, rows, 1), (*lead, rows)):
        return values.mul_(scales.reshape(*lead, rows, 1)).to(dtype)
    blocks_text = f", per {block_size} block {(*lead, *grid)}" if grid is not None else ""
    raise ModelLoadError(
        f"{name}: scales of shape {shape} fit FP8 weight {tuple(weight.shape)} neither per "
        f"tensor (1), per row {(*lead, rows, 1)}{blocks_text}"
    )
