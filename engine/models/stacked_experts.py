"""Experts stored stacked, one tensor per layer for all of them (Qwen3-VL-MoE's releases),
cut into the engine's per-expert rows (``moe.Experts``: output-major, gate rows then up).

    mlp.experts.gate_up_proj  [E, H, 2I] as released (input-major, transformers 4's
                              batched-matmul layout), or [E, 2I, H] as transformers 5
                              saves it; gate columns (rows) first, then up
    mlp.experts.down_proj     [E, I, H] as released, or [E, H, I]

A tensor is transposed when its shape is the input-major one and not the output-major
one, as transformers 5 reads these files (a square tensor is read output-major: no
released checkpoint has one).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from engine.models.errors import ModelLoadError

STACKED_EXPERTS = re.compile(
    r"^(model\.(?:mtp_)?layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$"
)


def stacked_expert_pieces(
    prefix: str,  # "model.layers.{i}.mlp.experts"
    which: str,  # "gate_up_proj" or "down_proj"
    tensor: torch.Tensor,  # as stored
    full_shape: tuple[int, ...],  # the engine's parameter, [E, 2I, H] or [E, H, I]
    stored: str,  # its name in the file, for errors
) -> Iterator[tuple[str, int, int, torch.Tensor]]:
    """(parameter, expert, first row, rows) pieces of one stored tensor. Raises
    ``ModelLoadError`` for a shape that is neither layout of the parameter's."""
    param = f"{prefix}.{which}"
    output_major = tuple(full_shape[1:])
    if tensor.dim() != 3 or tensor.shape[0] != full_shape[0]:
        transpose = None
    elif tuple(tensor.shape[1:]) == output_major:
        transpose = False
    elif tuple(tensor.shape[1:]) == output_major[::-1]:
        transpose = True
    else:
        transpose = None
    if transpose is None:
        raise ModelLoadError(
            f"{stored} is {list(tensor.shape)}; the config says [{full_shape[0]}, "
            f"{output_major[1]}, {output_major[0]}] (or [{full_shape[0]}, {output_major[0]}, "
            f"{output_major[1]}])"
        )
    for expert in range(tensor.shape[0]):
        rows = tensor[expert].T if transpose else tensor[expert]
        if which == "down_proj":
            yield param, expert, 0, rows
        else:
            half = rows.shape[0] // 2
            yield param, expert, 0, rows[:half]
            yield param, expert, half, rows[half:]
