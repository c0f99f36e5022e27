"""Dynamic resolution's sizes and token counts equal transformers' ``smart_resize``."""

from __future__ import annotations

import io

import pytest

from common.image_grid import DynamicGrid, image_size


def test_resized_sizes_equal_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    grids = [DynamicGrid(), DynamicGrid(min_pixels=56 * 56, max_pixels=28 * 28 * 64)]
    sizes = [(1, 1), (27, 29), (56, 56), (100, 3000), (4000, 3000), (1024, 768), (333, 777)]
    for grid in grids:
        for width, height in sizes:
            expected = smart_resize(height, width, 28, grid.min_pixels, grid.max_pixels)
            assert grid.resized(width, height) == expected, (width, height)
            assert grid.num_tokens(width, height) == expected[0] * expected[1] // 28**2
    with pytest.raises(ValueError, match="aspect ratio"):
        DynamicGrid().resized(1, 201)


def test_image_size_reads_the_header():
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (37, 21)).save(buffer, format="PNG")
    assert image_size(buffer.getvalue()) == (37, 21)
    with pytest.raises(ValueError, match="not a readable image"):
        image_size(b"nope")
