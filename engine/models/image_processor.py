"""An image file's bytes to the vision encoder's input, as the checkpoint's
``preprocessor_config.json`` says: transformers' CLIP, SigLIP, Gemma 3 and Qwen2-VL image
processors (their Pillow backend; Gemma 3's without pan-and-scan), step for step, so the
pixels are the ones transformers computes.

1. Decode (Pillow) and make RGB: an image with other modes is laid over white first.
2. Resize (``size``): the shortest edge to ``shortest_edge``, the other in proportion
   (rounded down), or to ``height`` x ``width``, or (dynamic resolution, Qwen2-VL) to the
   multiples of 28 ``common/image_grid.py`` picks; Pillow's resampling filter ``resample``.
3. Center-crop to ``crop_size`` (``do_center_crop``).
4. Rescale (x ``rescale_factor``, in float64, then float32) and normalize per channel.

Steps 1-3 are ``image_pixels`` (uint8, what a request holds while it waits), step 4 is
``normalize`` (at encode time, on the device).

An image larger than ``MAX_IMAGE_PIXELS`` is refused before its pixels are decoded, so a
small file that inflates to gigabytes (a decompression bomb) costs nothing.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.image_grid import DynamicGrid

MAX_IMAGE_PIXELS = 50_000_000  # width x height
# transformers' defaults where a preprocessor_config.json leaves keys out (CLIP's).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image that cannot be read or is too large: the request's fault."""


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    shortest_edge: int | None  # resize the shortest edge to this, else to (height, width)
    height: int
    width: int
    resample: int  # a Pillow filter (3: bicubic)
    crop: tuple[int, int] | None  # (height, width) of the center crop; None: no crop
    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    grid: DynamicGrid | None = None  # dynamic resolution: each image its own size

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every processed image (not with ``grid``)."""
        if self.crop is not None:
            return self.crop
        if self.shortest_edge is not None:
            raise ValueError("a shortest-edge resize without a crop gives images of any size")
        return self.height, self.width


def read_image_processing(
    model_dir: str | Path, image_size: int, grid: DynamicGrid | None = None
) -> ImageProcessing:
    """The checkpoint's ``preprocessor_config.json``, or CLIP's defaults at the tower's
    ``image_size`` when it has none; with ``grid`` (dynamic resolution), Qwen2-VL's
    processor (bicubic, CLIP's normalization). Raises ``ValueError`` naming a key it
    cannot serve."""
    path = Path(model_dir) / "preprocessor_config.json"
    raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if grid is not None:
        normalize = raw.get("do_normalize", True)
        return ImageProcessing(
            shortest_edge=None, height=0, width=0, resample=int(raw.get("resample", 3)),
            crop=None,
            rescale_factor=float(raw.get("rescale_factor", 1 / 255))
            if raw.get("do_rescale", True) else None,
            mean=tuple(raw.get("image_mean", _CLIP_MEAN)) if normalize else None,
            std=tuple(raw.get("image_std", _CLIP_STD)) if normalize else None,
            grid=grid,
        )  # fmt: skip
    if raw.get("do_pan_and_scan"):
        raise ValueError(f"{path}: do_pan_and_scan (Gemma 3's crops) is not served")
    size = raw.get("size") or {"shortest_edge": image_size}
    if isinstance(size, int):
        size = {"shortest_edge": size}
    crop = None
    if raw.get("do_center_crop", "crop_size" in raw or "shortest_edge" in size):
        crop_size = raw.get("crop_size") or {"height": image_size, "width": image_size}
        if isinstance(crop_size, int):
            crop_size = {"height": crop_size, "width": crop_size}
        crop = (int(crop_size["height"]), int(crop_size["width"]))
    shortest = size.get("shortest_edge")
    if shortest is None and not {"height", "width"} <= size.keys():
        raise ValueError(f"{path}: size {size!r} is not served (shortest_edge, or height, width)")
    if crop is not None and shortest is not None and min(crop) > int(shortest):
        raise ValueError(f"{path}: a crop of {crop} from a shortest edge of {shortest} pads")
    processing = ImageProcessing(
        shortest_edge=int(shortest) if shortest is not None else None,
        height=int(size.get("height", 0)),
        width=int(size.get("width", 0)),
        resample=int(raw.get("resample", 3)),
        crop=crop,
        rescale_factor=float(raw.get("rescale_factor", 1 / 255))
        if raw.get("do_rescale", True)
        else None,
        mean=tuple(raw.get("image_mean", _CLIP_MEAN)) if raw.get("do_normalize", True) else None,
        std=tuple(raw.get("image_std", _CLIP_STD)) if raw.get("do_normalize", True) else None,
    )
    if processing.output_size != (image_size, image_size):
        raise ValueError(
            f"{path}: images come out {processing.output_size}; the vision tower takes "
            f"{image_size} x {image_size}"
        )
    return processing


def check_image(data: bytes) -> tuple[int, int]:
    """(width, height) of the image in ``data``, from its header; nothing past it is read
    (microseconds). Raises ``ImageError`` unless it is an image's of at most
    ``MAX_IMAGE_PIXELS``."""
    return _open(data).size


def _open(data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"not a readable image: {exc}") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"the image is {width} x {height} pixels; at most {MAX_IMAGE_PIXELS} are served"
        )
    return image


def decode_image(data: bytes) -> Any:
    """The image in ``data`` (a PNG, JPEG, WebP, GIF, ... file), RGB. Raises ``ImageError``."""
    from PIL import Image

    image = _open(data)
    try:
        image.load()
        if image.mode == "RGB":
            return image
        # As transformers' convert_to_rgb: over a white background.
        rgba = image.convert("RGBA")
    except Exception as exc:  # Pillow raises SyntaxError, EOFError, struct and zlib
        # errors too for a broken file past its header: one escaped a decode worker's
        # step and took the worker down (a worker-input audit, 2026-12-01)
        raise ImageError(f"not a readable image: {exc}") from None
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def image_pixels(data: bytes, processing: ImageProcessing) -> torch.Tensor:
    """``data`` decoded, resized and cropped: [3, height, width] uint8 (a quarter of the
    float32 pixels' bytes, what a request holds until its image is encoded)."""
    image = decode_image(data)
    width, height = image.size
    if processing.grid is not None:
        try:
            new_height, new_width = processing.grid.resized(width, height)
        except ValueError as exc:
            raise ImageError(str(exc)) from None
        size = (new_width, new_height)
    elif processing.shortest_edge is not None:
        short, long = sorted((width, height))
        edge = processing.shortest_edge
        new_long = int(edge * long / short)
        size = (edge, new_long) if width <= height else (new_long, edge)
    else:
        size = (processing.width, processing.height)
    if size != (width, height):
        image = image.resize(size, resample=processing.resample)
    pixels = np.asarray(image)  # [H, W, 3] uint8
    if processing.crop is not None:
        crop_h, crop_w = processing.crop
        top = (pixels.shape[0] - crop_h) // 2
        left = (pixels.shape[1] - crop_w) // 2
        pixels = pixels[top : top + crop_h, left : left + crop_w]
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def normalize(pixels: torch.Tensor, processing: ImageProcessing) -> torch.Tensor:
    """[..., 3, H, W] uint8 -> float32 on ``pixels``' device: rescaled in float64 then
    float32, normalized per channel in float32, as transformers' processors do."""
    values = pixels.float()
    if processing.rescale_factor is not None:
        values = (pixels.double() * processing.rescale_factor).float()
    if processing.mean is not None and processing.std is not None:
        mean = torch.tensor(processing.mean, dtype=torch.float32, device=pixels.device)
        std = torch.tensor(processing.std, dtype=torch.float32, device=pixels.device)
        values = (values - mean[:, None, None]) / std[:, None, None]
    return values
