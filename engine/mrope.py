"""Qwen2.5-VL's M-RoPE positions: a prompt's rotary positions are 3-D (time, row, column).

Text tokens count up one by one, the same on all three rows. An image's tokens all take
the image's first position as time, and add their row and column in the image's token
grid; the text after the image continues from the first position plus the larger side of
the grid. So a prompt's last position is below its length when it holds images, and every
later token (generated, or a resumed sequence's) is at its sequence position plus
``delta`` (that difference), on all three rows, as transformers' ``get_rope_index`` and its
cached ``rope_deltas`` place them.

The positions follow from the prompt's length and each image's place and grid alone, so
every worker computes the same ones (a decode worker for its pulled KV's later tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class MropePositions:
    """A prompt's rotary positions, and ``delta`` for every position past it."""

    prompt: np.ndarray  # [3, num_prompt_tokens] int64
    delta: int

    def rows(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] rotary positions of sequence positions ``[start, end)``."""
        num_prompt = self.prompt.shape[1]
        if end <= num_prompt:
            return self.prompt[:, start:end]
        later = np.arange(max(start, num_prompt), end, dtype=np.int64) + self.delta
        if start >= num_prompt:
            return np.broadcast_to(later, (3, later.size))
        return np.concatenate((self.prompt[:, start:], np.broadcast_to(later, (3, later.size))), 1)


def mrope_positions(
    num_prompt_tokens: int, images: Sequence[tuple[int, int, int]]
) -> MropePositions:
    """``images``: (offset, rows, columns) of each image's token grid, in prompt order (its
    ``rows * columns`` placeholders start at ``offset``)."""
    positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
    current = cursor = 0  # the next position; the next prompt index to place
    for offset, rows, columns in images:
        positions[:, cursor:offset] = current + np.arange(offset - cursor)
        current += offset - cursor
        end = offset + rows * columns
        positions[0, offset:end] = current
        positions[1, offset:end] = current + np.repeat(np.arange(rows), columns)
        positions[2, offset:end] = current + np.tile(np.arange(columns), rows)
        current += max(rows, columns)
        cursor = end
    positions[:, cursor:] = current + np.arange(num_prompt_tokens - cursor)
    current += num_prompt_tokens - cursor
    return MropePositions(positions, current - num_prompt_tokens)
