"""A request's images inside the engine: checked and decoded when it is added
(``prepare_images``; services do this off the engine thread), encoded when a step first
computes one of their placeholder tokens (``image_embeds``).

A request whose prompt KV is pulled from a prefill worker (a decode worker's) has its
images' headers checked but their pixels left undecoded (10-20 ms of CPU for a 1024 x 768
image, usually never needed): they are decoded only if it must compute its prompt here
after all (a failed pull, a preemption: ``decode_pixels``).

An image's encoder output is kept on its request (``Request.image_features``) only while
a chunked prompt is part-way through its placeholders, so that the next chunk does not
encode it again; it goes with the chunk that computes its last placeholder, and with the
request when that ends. A prefix-cache hit over a whole image skips its encoding; one
that ends inside an image (its last block also holds the text after it, which differs
between questions about one image) finds its rows in the ``EncoderCache`` if the image
was encoded recently.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.multimodal import ImageInput, ImageSpan, check_image_spans, image_digest
from common.vision_spec import VisionSpec
from engine.errors import InvalidRequestError
from engine.models.image_processor import (
    ImageError,
    ImageProcessing,
    check_image,
    image_pixels,
    normalize,
)
from engine.models.vision import AnyVisionEncoder

# Images per encoder call: a step that reaches many new images (a burst of requests)
# encodes them in groups, so the tower's activations stay bounded (CLIP-L's attention
# scores alone are ~21 MB an image in float32: 16 heads x 577 x 577).
ENCODER_BATCH = 16
# And at most this many pixels per call (one image at least): under dynamic resolution an
# image may hold 12.8 M pixels (Qwen2.5-VL's bound), ~300 MB in float64 while it is
# normalized, with its tower's activations on top; 16 such in one call ran a GPU out of
# memory on paper (a review's arithmetic). CLIP-L's 336 x 336 images still go 16 at once.
ENCODER_BATCH_PIXELS = 1 << 22


@dataclass(slots=True, eq=False)
class PromptImage:
    span: ImageSpan
    # [3, H, W] uint8 on the host, resized and cropped (normalized when encoded, on the
    # device); None: not decoded yet.
    pixels: torch.Tensor | None
    data: bytes | None = None  # the encoded file while ``pixels`` is None
    size: tuple[int, int] = (0, 0)  # (width, height) of the file's image


def decode_pixels(image: PromptImage, processing: ImageProcessing) -> None:
    """Decode an image prepared undecoded (``prepare_images(decode=False)``). Raises
    ``ImageError``."""
    if image.pixels is None:
        assert image.data is not None
        image.pixels = _pixels(image.data, image.size, processing)
        image.data = None


def _pixels(data: bytes, size: tuple[int, int], processing: ImageProcessing) -> torch.Tensor:
    """``image_pixels``, checked against ``size`` (its header's) under dynamic resolution,
    where the header's size set the image's token count and positions. Raises
    ``ImageError``."""
    pixels = image_pixels(data, processing)
    if processing.grid is not None and tuple(pixels.shape[1:]) != processing.grid.resized(*size):
        raise ImageError(f"the image decodes to another size than its header's {size}")
    return pixels


@dataclass(slots=True)
class ChunkImages:
    """The images a chunk's positions overlap, and its request's store of encoder output
    (image index -> [num_tokens, rows_width]) that the runner reads and updates.
    ``cache_salt``: its request's tenant (``EncoderCache`` keys)."""

    images: tuple[tuple[int, PromptImage], ...]  # (index in the request, image)
    features: dict[int, torch.Tensor]
    cache_salt: str | None = None

    def cache_key(self, digest: bytes) -> bytes:
        """An image's ``EncoderCache`` key: its digest, within its tenant. Shared across
        salts, an image another tenant sent was not encoded again, and the time to first
        token told a tenant so: the side channel ``cache_salt`` closes for the KV."""
        if self.cache_salt is None:
            return digest
        salt = self.cache_salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(len(salt).to_bytes(8, "little") + salt + digest).digest()


class EncoderCache:
    """Encoder output by image digest, the least recently used dropped past ``max_bytes``
    (``engine.encoder_cache_bytes``). Owned by the runner (the engine thread)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, digest: bytes) -> torch.Tensor | None:
        rows = self._rows.get(digest)
        if rows is not None:
            self._rows.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or digest in self._rows:
            return
        self._rows[digest] = rows
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()


def prepare_images(
    prompt: Sequence[int],
    images: Sequence[ImageInput | PromptImage],
    vision: VisionSpec | None,
    processing: ImageProcessing | None,
    decode: bool = True,
) -> tuple[PromptImage, ...]:
    """``images`` checked against ``prompt`` and decoded (already prepared ones kept;
    without ``decode``, only their headers read). Raises ``InvalidRequestError`` (param
    ``images``) for a model without an encoder, an image that cannot be read, or
    placements that do not match the prompt's placeholders; a prompt with placeholders
    needs its images."""
    if vision is None:
        if images:
            raise InvalidRequestError("this model takes no images (no vision encoder)", "images")
        return ()
    assert processing is not None
    prepared = []
    for index, image in enumerate(images):
        if isinstance(image, PromptImage):
            prepared.append(image)
            continue
        try:
            size = check_image(image.data)
            try:
                num_tokens = vision.num_tokens(size)
            except ValueError as exc:  # a size dynamic resolution refuses
                raise ImageError(str(exc)) from None
            span = ImageSpan(image.offset, num_tokens, image_digest(image.data))
            if decode:
                prepared.append(PromptImage(span, _pixels(image.data, size, processing), size=size))
            else:
                prepared.append(PromptImage(span, None, image.data, size))
        except ImageError as exc:
            raise InvalidRequestError(f"images[{index}]: {exc}", "images") from None
    problem = check_image_spans(prompt, [p.span for p in prepared], vision.image_token_id)
    if problem is not None:
        raise InvalidRequestError(problem, "images")
    return tuple(prepared)


def chunk_images(
    images: tuple[PromptImage, ...],
    features: dict[int, torch.Tensor],
    start: int,
    end: int,
    cache_salt: str | None = None,
) -> ChunkImages | None:
    """What a chunk of positions ``[start, end)`` needs of its request's ``images``."""
    overlapping = tuple(
        (index, image)
        for index, image in enumerate(images)
        if image.span.offset < end and image.span.end > start
    )
    return ChunkImages(overlapping, features, cache_salt) if overlapping else None


def image_embeds(
    encoder: AnyVisionEncoder,
    processing: ImageProcessing,
    cache: EncoderCache,
    chunks: Sequence[tuple[int, int, int, ChunkImages]],
    device: torch.device,
) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """The rows of a step's flattened batch that are image placeholders and what goes
    there, (rows [m] int64, embeddings [m, ``VisionSpec.rows_width``]: the input embedding,
    then any DeepStack rows), and how many images were encoded for it. ``chunks``: (first
    batch row, first position, end position, images) of each chunk with images. Images
    neither in their request's store nor in ``cache`` are encoded together (an image twice
    in the step, once; images of one pixel size per call); each chunk's store keeps an
    image's rows only while its run goes on past the chunk."""
    needed: dict[bytes, list[tuple[ChunkImages, int]]] = {}
    pixels: dict[bytes, torch.Tensor] = {}
    for _, _, _, store in chunks:
        for index, image in store.images:
            if index in store.features:
                continue
            digest = store.cache_key(image.span.digest)
            cached = cache.get(digest)
            if cached is not None:
                store.features[index] = cached
                continue
            needed.setdefault(digest, []).append((store, index))
            assert image.pixels is not None, "decode_pixels runs before a chunk reads it"
            pixels[digest] = image.pixels
    by_size: dict[tuple[int, ...], list[bytes]] = {}
    for digest in needed:  # dynamic resolution: each size its own calls
        by_size.setdefault(tuple(pixels[digest].shape), []).append(digest)
    groups = []
    for size, digests in by_size.items():
        per_call = max(1, min(ENCODER_BATCH, ENCODER_BATCH_PIXELS // (size[-2] * size[-1])))
        groups += [digests[first : first + per_call] for first in range(0, len(digests), per_call)]
    for group in groups:
        batch = torch.stack([pixels[d] for d in group]).to(device)  # [n, 3, H, W] uint8
        encoded = encoder(normalize(batch, processing))  # [n, tokens, hidden]
        for digest, image_rows in zip(group, encoded, strict=True):
            rows = image_rows.clone()  # its own storage: the cache counts its bytes
            cache.put(digest, rows)
            for store, index in needed[digest]:
                store.features[index] = rows
    all_rows: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    for first_row, start, end, store in chunks:
        for index, image in store.images:
            span = image.span
            lo, hi = max(span.offset, start), min(span.end, end)
            features = store.features[index]
            parts.append(features[lo - span.offset : hi - span.offset])
            all_rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
            if hi == span.end:  # its last placeholder is computed now
                del store.features[index]
    rows = torch.cat(all_rows).to(device)
    return (rows, torch.cat(parts)), len(needed)


def attention_groups(spans: Sequence[ImageSpan]) -> list[tuple[int, int]]:
    """[start, end) of each run of images whose tokens attend to each other (Gemma 3):
    an image, or images with no token between them, which transformers makes one group
    (its mask groups consecutive image tokens); Gemma 3's processor never writes them so."""
    groups: list[tuple[int, int]] = []
    for span in spans:
        if groups and groups[-1][1] == span.offset:
            groups[-1] = (groups[-1][0], span.end)
        else:
            groups.append((span.offset, span.end))
    return groups


def image_key_ends(
    positions: Sequence[int], chunks: Sequence[tuple[int, int, int, ChunkImages]]
) -> list[int]:
    """``HostBatch.key_ends`` of a step whose images attend both ways (Gemma 3): per
    batch row (``positions``), the end of the positions it attends to: its own + 1, or
    for an image's token its group's end (``attention_groups``). ``chunks``: as
    ``image_embeds``'. Each group a chunk computes part of ends within it (the
    scheduler's promise: ``whole_image_end``), so all of its images are the chunk's."""
    key_ends = [position + 1 for position in positions]
    for first_row, start, end, store in chunks:
        for group_start, group_end in attention_groups([image.span for _, image in store.images]):
            if group_end > end:
                raise RuntimeError(
                    f"a chunk of positions [{start}, {end}) cuts the image at "
                    f"[{group_start}, {group_end}), whose tokens attend to each other"
                )
            lo = max(group_start, start)
            key_ends[first_row + lo - start : first_row + group_end - start] = [group_end] * (
                group_end - lo
            )
    return key_ends


def whole_image_end(images: Sequence[PromptImage], start: int, end: int, max_end: int) -> int:
    """Where a chunk of positions from ``start`` that would end at ``end`` ends when images'
    tokens attend to each other (Gemma 3), so that it computes each image group
    (``attention_groups``) it touches to the group's end: ``end`` outside groups; before
    the group ``end`` falls in when the chunk reaches it from text; that group's end when
    the chunk starts inside or at it and may grow that far (``max_end``: the step's
    budget); else ``start`` (not this step)."""
    for group_start, group_end in attention_groups([image.span for image in images]):
        if group_start < end < group_end:
            if group_start > start:
                return group_start
            return group_end if group_end <= max_end else start
    return end
