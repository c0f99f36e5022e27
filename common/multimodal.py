"""Images in a prompt, as the router and the engine both see them (torch-free).

A vision-language model's prompt holds, for each image, a run of ``tokens_per_image``
placeholder tokens (the checkpoint's ``image_token_id``); the vision encoder's output for
the image replaces their embeddings (``engine/models/vision.py``). A chat template writes
one marker per image (LLaVA's ``<image>``, Gemma 3's ``<start_of_image>``), which becomes
the image's sequence (``ImageText``): in the text before it is tokenized, as transformers'
processors do (Gemma 3's sequence starts and ends with newlines, which merge with the
text's own into one token), or in ids for a prompt given as ids. ``image_offsets`` then
finds each image's run.

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
from typing import Protocol, TypeVar

from common.image_grid import image_size
from common.vision_spec import VisionSpec

T = TypeVar("T")


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
    overlapping it, and each image chained to one of those by adjacency (one's run
    ending where the next begins), in prompt order, where its run starts relative to
    ``start`` and its digest; None when it overlaps none (a text block's hash is then
    unchanged). ``spans`` are in prompt order. Adjacent images are one attention group
    where images attend both ways (Gemma 3): the first's KV depends on the second, so
    "[A][B]" and "[A][C]" shared the blocks of A alone, and the second served the
    first's KV (a cached run's tokens differed from an uncached one's)."""
    overlapping = [i for i, span in enumerate(spans) if span.offset < end and span.end > start]
    if not overlapping:
        return None
    first, last = overlapping[0], overlapping[-1]
    while first > 0 and spans[first - 1].end == spans[first].offset:
        first -= 1
    while last + 1 < len(spans) and spans[last].end == spans[last + 1].offset:
        last += 1
    return b"".join(
        struct.pack("<q", span.offset - start) + span.digest for span in spans[first : last + 1]
    )


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


class _Tokenizer(Protocol):
    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ImageText:
    """How a prompt holds its images, in text and in ids (``VisionSpec.image_text``): each
    marker becomes ``lead``, the image's placeholders, ``tail``."""

    marker: str  # what a chat template (or a user) writes for an image
    lead: str
    placeholder: str
    tail: str
    marker_id: int
    placeholder_id: int
    lead_ids: tuple[int, ...]  # ``lead`` and ``tail`` tokenized alone: for prompts of ids
    tail_ids: tuple[int, ...]

    @classmethod
    def of(cls, vision: VisionSpec, tokenizer: _Tokenizer) -> ImageText:
        """Raises ``ValueError`` when the tokenizer lacks the model's image tokens."""
        ids = [vision.marker_token_id, vision.image_token_id, vision.end_token_id]
        texts = tokenizer.convert_ids_to_tokens([i for i in ids if i is not None])
        if not all(texts):
            raise ValueError(
                f"the tokenizer has no text for the image token ids {ids}: images cannot be "
                "written in prompts"
            )

        def token_text(token_id: int) -> str:
            return tokenizer.convert_ids_to_tokens([token_id])[0]

        def ids_of(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

        marker, lead, tail = vision.image_text(token_text)
        return cls(marker, lead, token_text(vision.image_token_id), tail,
                   vision.marker_token_id, vision.image_token_id, ids_of(lead),
                   ids_of(tail))  # fmt: skip

    def sequence(self, num_tokens: int) -> str:
        """What a marker becomes for an image of ``num_tokens`` placeholders."""
        return self.lead + self.placeholder * num_tokens + self.tail

    def expand(self, text: str, counts: Sequence[int]) -> str:
        """``text`` with the i-th marker made the sequence of an image of ``counts[i]``
        placeholders. A count of markers that differs from the images' raises
        ``ValueError``."""
        parts = text.split(self.marker)
        _check_count(len(parts) - 1, len(counts), f"{self.marker!r} markers")
        pieces = [parts[0]]
        for count, part in zip(counts, parts[1:], strict=True):
            pieces += [self.sequence(count), part]
        return "".join(pieces)

    def expand_ids(self, token_ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """``expand`` of a prompt given as ids: each marker id made ``lead_ids``, the
        placeholders, ``tail_ids``."""
        _check_count(list(token_ids).count(self.marker_id), len(counts),
                     f"image markers (id {self.marker_id})")  # fmt: skip
        expanded: list[int] = []
        images = iter(counts)
        for token_id in token_ids:
            if token_id == self.marker_id:
                expanded += [*self.lead_ids, *[self.placeholder_id] * next(images),
                             *self.tail_ids]  # fmt: skip
            else:
                expanded.append(token_id)
        return expanded


def image_token_counts(vision: VisionSpec, images: Sequence[bytes]) -> list[int]:
    """Each image's placeholder count: the model's fixed one, or under dynamic resolution
    (Qwen2.5-VL) its size's, read from its header (``common/image_grid.py``). Raises
    ``ValueError`` naming the image (``images[i]``) for an unreadable header or a size
    dynamic resolution refuses."""
    if vision.grid is None:
        return [vision.tokens_per_image] * len(images)
    counts = []
    for index, data in enumerate(images):
        try:
            counts.append(vision.num_tokens(image_size(data)))
        except ValueError as exc:
            raise ValueError(f"images[{index}]: {exc}") from None
    return counts


def _check_count(count: int, num_images: int, what: str) -> None:
    if count != num_images:
        raise ValueError(
            f"the prompt holds {count} {what} for {num_images} images: a text may not "
            "contain the image tokens themselves"
        )


def image_offsets(
    token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> list[int]:
    """Where each image's run of placeholders starts in an expanded prompt: the i-th image
    takes ``counts[i]`` of them, in order (adjacent images' runs merge: a run is split in
    images). Raises ``ValueError`` when the runs are not those images."""
    runs = placeholder_runs(token_ids, image_token_id)
    starts: list[int] = []
    images = iter(counts)
    for offset, length in runs:
        end = offset + length
        while offset < end:
            count = next(images, None)
            if count is None or offset + count > end:
                break
            starts.append(offset)
            offset += count
        if offset != end:
            break
    else:
        if len(starts) == len(counts):
            return starts
    described = ", ".join(f"{length} at {offset}" for offset, length in runs[:8])
    raise ValueError(
        f"the prompt's image placeholder runs (id {image_token_id}: {described or 'none'})"
        f" are not its {len(counts)} images of {list(counts)[:8]} tokens: a text may not "
        "contain the image tokens themselves"
    )


def check_image_spans(
    token_ids: Sequence[int], spans: Sequence[ImageSpan], image_token_id: int
) -> str | None:
    """Why ``spans`` do not place images in ``token_ids`` (None when they do): each must
    cover a whole run of placeholders (or its part, where images are adjacent), in
    prompt order, and every placeholder must belong to one (the model has no embedding
    for a bare one)."""
    try:
        starts = image_offsets(token_ids, image_token_id, [span.num_tokens for span in spans])
    except ValueError as exc:
        return str(exc)
    given = [span.offset for span in spans]
    if given != starts:
        return (
            f"{len(spans)} images at positions {given[:8]} do not match the prompt's image "
            f"placeholder runs, which start at {starts[:8]} (id {image_token_id})"
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
    render: Callable[[str | None], T], marker: str, errors: tuple[type[Exception], ...]
) -> T:
    """A chat's prompt with its images. ``render(None)`` gives the template each image as
    a content part (``{"type": "image"}``: what vision models' templates read);
    ``render(marker)``, as ``marker`` where it was in string content. Parts first; where
    that raises one of ``errors`` (a template that reads content as a string and fails on
    a list, or one that does not write the marker once per image: ``ImageText.expand``
    raises), text."""
    try:
        return render(None)
    except errors:
        return render(marker)
