"""Images in chat messages, for a vision-language model (``common/vision_spec.py``).

1. ``image_refs``, then ``read_images``: each ``image_url`` content part's bytes, in
   message order: a ``data:`` URL's, or an http(s) URL's from a host the operator allows
   (``router/media_fetch.py``; none by default), fetched concurrently. Together they fit
   the request's budget (``router.max_request_bytes``).
2. The chat template writes one marker per image (``ChatMessage.for_template``: as
   content parts, else as the marker's text in a string), and each marker becomes the
   image's sequence in the text before it is tokenized (``ImageText``).
3. ``place_images``: each image is placed on its run of placeholders, with its digest for
   the block hashes (``common/multimodal.py``).

The workers decode and check the images; one they cannot read is their 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from common.multimodal import (
    ImageSpan,
    ImageText,
    data_url_bytes,
    image_digest,
    image_offsets,
    image_token_counts,
)
from common.tokenizer import Tokenizer
from common.vision_spec import VisionSpec
from proto import pdserve_pb2 as pb
from router.errors import bad_request
from router.media_fetch import ImageBudget, MediaFetcher
from router.protocol import ChatMessage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images as the workers get them, and as its block hashes key them."""

    messages: tuple[pb.Image, ...]
    spans: tuple[ImageSpan, ...]


def image_text_of(vision: VisionSpec | None, tokenizer: Tokenizer) -> ImageText | None:
    """How prompts hold the model's images; None for a model without images, or whose
    tokenizer lacks its image tokens (logged: it serves text only)."""
    if vision is None:
        return None
    try:
        return ImageText.of(vision, tokenizer)
    except ValueError as exc:
        logger.warning("%s; images are refused", exc)
        return None


def image_refs(
    messages: Sequence[ChatMessage], image_text: ImageText | None, max_images: int
) -> list[tuple[str, str | None]]:
    """(param, URL) of each image of ``messages``, in order. Raises a 400 ``APIError``
    naming the part for a model without images (``image_text`` None), or too many."""
    found = [
        (f"messages[{i}].content[{j}].image_url", part.url)
        for i, message in enumerate(messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.type == "image_url"
    ]
    if not found:
        return []
    if image_text is None:
        raise bad_request(
            "this model takes no images: it has no vision encoder (or its tokenizer no image "
            "tokens)",
            found[0][0],
        )
    if len(found) > max_images:
        raise bad_request(
            f"{len(found)} images; at most {max_images} per request "
            "(router.max_images_per_request)",
            "messages",
        )
    return found


async def read_images(
    refs: list[tuple[str, str | None]], fetcher: MediaFetcher, max_bytes: int
) -> list[bytes]:
    """The bytes of each image ``image_refs`` found: ``data:`` URLs decoded (on a thread:
    24 MB of base64 took 0.23 s), http(s) ones fetched (all at once), at most
    ``max_bytes`` in all. Raises a 400 naming the part."""
    images = await asyncio.to_thread(_read_inline, refs, fetcher)
    budget = ImageBudget(max_bytes)
    budget.take(sum(len(image) for image in images if image is not None), "messages")
    remote = [(i, param, url) for i, (param, url) in enumerate(refs) if images[i] is None]
    if remote:
        async with fetcher.client() as client:
            try:  # a failed fetch cancels the others
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(fetcher.fetch(client, url, param, budget))
                             for _, param, url in remote]  # fmt: skip
            except ExceptionGroup as failed:  # each is a 400 (MediaFetcher.fetch)
                raise failed.exceptions[0] from None
        for (index, _, _), task in zip(remote, tasks, strict=True):
            images[index] = task.result()
    return [image for image in images if image is not None]


def _read_inline(refs: list[tuple[str, str | None]], fetcher: MediaFetcher) -> list[bytes | None]:
    """Each part's ``data:`` URL decoded, an http(s) one checked (None: to fetch), in the
    parts' order: the first bad part is the one a 400 names."""
    images: list[bytes | None] = []
    for param, url in refs:
        if not url:
            raise bad_request("an image_url part needs its url", param)
        if url.startswith("data:"):
            images.append(read_data_url(url, param))
        else:
            fetcher.check(url, param)
            images.append(None)
    return images


def read_data_url(url: str, param: str) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL; a 400 naming ``param``."""
    try:
        return data_url_bytes(url)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def image_counts(images: list[bytes], vision: VisionSpec) -> list[int]:
    """Each image's placeholder count (``image_token_counts``); an unreadable header or a
    refused size is a 400."""
    try:
        return image_token_counts(vision, images)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def place_images(
    prompt: list[int], images: list[bytes], vision: VisionSpec, counts: list[int]
) -> tuple[list[int], PromptImages]:
    """``images`` placed on the runs of placeholders of ``prompt`` (expanded: its markers
    made the images' sequences). Runs that are not ``images`` whole images are a 400
    (``image_offsets``: a text that spells the placeholder itself). ``counts``: each
    image's placeholders (``image_counts``)."""
    try:
        offsets = image_offsets(prompt, vision.image_token_id, counts)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    messages = tuple(pb.Image(offset=o, data=d) for o, d in zip(offsets, images, strict=True))
    spans = tuple(
        ImageSpan(o, n, image_digest(d)) for o, n, d in zip(offsets, counts, images, strict=True)
    )
    return prompt, PromptImages(messages, spans)
