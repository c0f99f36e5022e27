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


def expand_block_scales(
    scales: torch.Tensor,  # [..., grid rows, grid cols]
    block_size: tuple[int, int],
    rows: int,
    cols: int,
) -> torch.Tensor:  # [..., rows, cols]: each element's block scale
    """Each block's scale repeated over its elements (the last blocks cut to the weight)."""
    expanded = scales.repeat_interleave(block_size[0], -2)[..., :rows, :]
    return expanded.repeat_interleave(block_size[1], -1)[..., :cols]


def dequantize_fp8(
    weight: torch.Tensor,  # [..., rows, cols] float8; leading dims: stacked experts
    scale: torch.Tensor,  # float (or E8M0) scales, in one of the shapes below
    block_size: tuple[int, int] | None,
    dtype: torch.dtype,
    name: str,
) -> torch.Tensor:  # [..., rows, cols] in dtype
    """``weight`` times its scales, in ``dtype``. The scales' shape says their layout:
    one scale ([], [1], or [1, 1]); one per expert of stacked experts ([E] or [E, 1, 1]);
    one per ``block_size`` block ([..., ceil(rows / br), ceil(cols / bc)]); one per row
    ([..., rows, 1] or [..., rows]). Any other shape raises ModelLoadError naming
    ``name`` and both shapes."""
    rows, cols = weight.shape[-2:]
    lead = tuple(weight.shape[:-2])
    values, scales = weight.to(torch.float32), scale.to(torch.float32)  # values: scaled in place
    shape = tuple(scales.shape)
    if shape in ((), (1,)):
        return values.mul_(scales.reshape(())).to(dtype)
    if shape == (*lead, 1, 1) or (lead and shape == lead):
        return values.mul_(scales.reshape(*lead, 1, 1)).to(dtype)
    grid = None if block_size is None else (math.ceil(rows / block_size[0]),
                                            math.ceil(cols / block_size[1]))  # fmt: skip
    if grid is not None and shape == (*lead, *grid):
        assert block_size is not None
        if rows % block_size[0] == 0 and cols % block_size[1] == 0:  # one pass, no copy
            blocks = values.view(*lead, grid[0], block_size[0], grid[1], block_size[1])
            blocks.mul_(scales[..., :, None, :, None])
            return values.to(dtype)
        return values.mul_(expand_block_scales(scales, block_size, rows, cols)).to(dtype)
    if shape in ((*lead, rows, 1), (*lead, rows)):
        return values.mul_(scales.reshape(*lead, rows, 1)).to(dtype)
    blocks_text = f", per {block_size} block {(*lead, *grid)}" if grid is not None else ""
    raise ModelLoadError(
        f"{name}: scales of shape {shape} fit FP8 weight {tuple(weight.shape)} neither per "
        f"tensor (1){f', per expert {lead}' if lead else ''}, per row {(*lead, rows, 1)}"
        f"{blocks_text}"
    )
