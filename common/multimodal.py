"""Images in a prompt, as the router and the engine both see them (torch-free).

A vision-language model's prompt holds, for each image, a run of ``tokens_per_image``
placeholder tokens (the checkpoint's ``image_token_id``); the vision encoder's output for
the image replaces their embeddings (``engine/models/vision.py``). A chat template writes
one placeholder per image; ``expand_placeholders`` makes it the run, as transformers'
processors do.

The prefix cache cannot key such blocks by their token ids alone: every image's run is the
same ids. A block that overlaps a run is keyed by the image's digest (sha256 of its encoded
bytes) and by where the run starts relative to the block too (``block_extra``, the
``extra`` of ``common.hashing.hash_block``): two images never share KV, and one image in
the same place after the same tokens does, in every worker and in the router's index.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image of a request as it arrives: where its placeholder run starts in the prompt,
    and its encoded file (PNG, JPEG, WebP, GIF, ...)."""

    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where one image sits in a prompt, and what it is."""

    offset: int  # prompt position of its first placeholder token
    num_tokens: int  # its placeholder tokens (the encoder's rows)
    digest: bytes  # sha256 of the image's encoded bytes (``image_digest``)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_digest(data: bytes) -> bytes:
    """What an image is keyed by: the sha256 of its encoded file (PNG, JPEG, ...)."""
    return hashlib.sha256(data).digest()


def block_extra(spans: Sequence[ImageSpan], start: int, end: int) -> bytes | None:
    """The hash ``extra`` of the block of prompt positions ``[start, end)``: for each image
    overlapping it, in prompt order, where its run starts relative to ``start`` and its
    digest; None when it overlaps none (a text block's hash is then unchanged)."""
    parts = [
        struct.pack("<q", span.offset - start) + span.digest
        for span in spans
        if span.offset < end and span.end > start
    ]
    return b"".join(parts) or None


def placeholder_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """Each maximal run of ``image_token_id`` in ``token_ids``: (offset, length)."""
    runs: list[tuple[int, int]] = []
    if image_token_id not in token_ids:  # at C speed: most prompts hold no image
        return runs
    start = None
    for position, token_id in enumerate(token_ids):
        if token_id == image_token_id and start is None:
            start = position
        elif token_id != image_token_id and start is not None:
            runs.append((start, position - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs


def expand_placeholders(
    token_ids: Sequence[int],
    image_token_id: int,
    tokens_per_image: int,
    num_images: int | None = None,
) -> tuple[list[int], list[int]]:
    """``token_ids`` with each ``image_token_id`` (one per image, as a chat template or a
    user writes it) made a run of ``tokens_per_image``: (the ids, each run's offset).
    With ``num_images``, a count of image tokens that differs (a text that spells the
    image token itself, a template that dropped an image) raises ``ValueError``."""
    expanded: list[int] = []
    offsets: list[int] = []
    for token_id in token_ids:
        if token_id == image_token_id:
            offsets.append(len(expanded))
            expanded.extend([image_token_id] * tokens_per_image)
        else:
            expanded.append(token_id)
    if num_images is not None and len(offsets) != num_images:
        raise ValueError(
            f"the prompt holds {len(offsets)} image tokens (id {image_token_id}) for "
            f"{num_images} images: a text may not contain the image token itself"
        )
    return expanded, offsets


def check_image_spans(
    token_ids: Sequence[int],
    spans: Sequence[ImageSpan],
    image_token_id: int,
    tokens_per_image: int,
) -> str | None:
    """Why ``spans`` do not place images in ``token_ids`` (None when they do): each must
    cover exactly one whole run of ``tokens_per_image`` placeholders, in prompt order, and
    every placeholder must belong to one (the model has no embedding for a bare one)."""
    runs = placeholder_runs(token_ids, image_token_id)
    # Adjacent images' runs merge into one: split each run into images.
    starts = []
    for offset, length in runs:
        if length % tokens_per_image:
            return (
                f"the prompt has a run of {length} image placeholder tokens (id "
                f"{image_token_id}) at position {offset}; each image takes {tokens_per_image}"
            )
        starts.extend(range(offset, offset + length, tokens_per_image))
    given = [span.offset for span in spans]
    if any(span.num_tokens != tokens_per_image for span in spans) or given != starts:
        return (
            f"{len(spans)} images at positions {given[:8]} do not match the prompt's "
            f"{len(starts)} image placeholder runs at {starts[:8]} ({tokens_per_image} "
            f"tokens of id {image_token_id} each)"
        )
    return None


def data_url_bytes(url: str) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL. Raises ``ValueError`` saying
    what is wrong with it."""
    header, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        raise ValueError("an image's data: URL must be base64 (data:image/png;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image's data: URL holds invalid base64") from None
    if not data:
        raise ValueError("the image's data: URL is empty")
    return data


def render_with_images(
    render: Callable[[str | None], list[int]],
    image_token: str,
    image_token_id: int,
    num_images: int,
    errors: tuple[type[Exception], ...],
) -> list[int]:
    """A chat's ids with one ``image_token_id`` per image. ``render(None)`` gives the
    template each image as a content part (``{"type": "image"}``: what vision models'
    templates read); ``render(text)``, as ``text`` where it was in string content. Parts
    first; where that raises one of ``errors`` (a template that reads content as a
    string, and fails on a list) or does not write the token once per image, text."""
    try:
        token_ids = render(None)
    except errors:
        token_ids = []
    if token_ids.count(image_token_id) == num_images:
        return token_ids
    return render(image_token)
