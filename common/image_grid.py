"""Dynamic resolution (Qwen2-VL, Qwen2.5-VL): an image keeps its aspect ratio, resized so
both sides are multiples of ``patch_size * merge_size`` (28) and its area lies within
[``min_pixels``, ``max_pixels``] (transformers' ``smart_resize``); it is cut into
``patch_size`` patches, and each ``merge_size`` x ``merge_size`` group of patches is one
placeholder token. So an image's token count follows from its size, read from its header
(torch-free: the router counts them before any worker decodes the image).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_ASPECT_RATIO = 200  # transformers' limit


@dataclass(frozen=True, slots=True)
class DynamicGrid:
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to, as transformers' ``smart_resize``.
        Raises ``ValueError`` for an aspect ratio past ``MAX_ASPECT_RATIO``."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(
                f"the image is {width} x {height} pixels: an aspect ratio past "
                f"{MAX_ASPECT_RATIO} is not served"
            )
        factor = self.factor
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def token_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of the image's placeholder tokens (merged patch groups)."""
        h_bar, w_bar = self.resized(width, height)
        return h_bar // self.factor, w_bar // self.factor

    def num_tokens(self, width: int, height: int) -> int:
        rows, columns = self.token_grid(width, height)
        return rows * columns


def read_dynamic_grid(model_dir: Path, vision: dict[str, Any]) -> DynamicGrid:
    """The checkpoint's ``preprocessor_config.json`` (transformers 4's ``min_pixels`` /
    ``max_pixels`` or 5's ``size``), with ``vision``'s patch and merge sizes; the
    processor's defaults where it has none."""
    path = model_dir / "preprocessor_config.json"
    raw: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    size = raw.get("size") or {}
    defaults = DynamicGrid()
    return DynamicGrid(
        patch_size=int(raw.get("patch_size", vision.get("patch_size", defaults.patch_size))),
        merge_size=int(
            raw.get("merge_size", vision.get("spatial_merge_size", defaults.merge_size))
        ),
        min_pixels=int(raw.get("min_pixels", size.get("shortest_edge", defaults.min_pixels))),
        max_pixels=int(raw.get("max_pixels", size.get("longest_edge", defaults.max_pixels))),
    )


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image file's header (nothing else is read). Raises
    ``ValueError`` for bytes that are not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"not a readable image: {exc}") from None
