"""Images in chat messages, for a vision-language model (``common/vision_spec.py``).

1. ``image_inputs``: each ``image_url`` content part's bytes, in message order. Only
   ``data:`` URLs are read: the router fetches nothing from the network (a URL that makes
   a server fetch is a way into its private network), so clients send images inline.
2. The chat template writes one image token per image (``ChatMessage.for_template``: as
   content parts, else as the token's text in a string).
3. ``place_images``: each image token becomes its run of placeholders, and each image is
   placed on its run, with its digest for the block hashes (``common/multimodal.py``).

The workers decode and check the images; one they cannot read is their 400.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

from common.multimodal import ImageSpan, expand_placeholders, image_digest
from common.vision_spec import VisionSpec
from proto import pdserve_pb2 as pb
from router.errors import bad_request
from router.protocol import ChatMessage


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images as the workers get them, and as its block hashes key them."""

    messages: tuple[pb.Image, ...]
    spans: tuple[ImageSpan, ...]


def image_inputs(
    messages: Sequence[ChatMessage], vision: VisionSpec | None, max_images: int
) -> list[bytes]:
    """The images of ``messages``, in order. Raises a 400 ``APIError`` naming the part for
    a model without images, too many images, or a URL that is not a base64 ``data:`` URL."""
    found = [
        (f"messages[{i}].content[{j}].image_url", part.url)
        for i, message in enumerate(messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if part.type == "image_url"
    ]
    if not found:
        return []
    if vision is None:
        raise bad_request("this model takes no images: it has no vision encoder", found[0][0])
    if len(found) > max_images:
        raise bad_request(
            f"{len(found)} images; at most {max_images} per request "
            "(router.max_images_per_request)",
            "messages",
        )
    return [read_data_url(url, param) for param, url in found]


def read_data_url(url: str | None, param: str) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL."""
    if not url:
        raise bad_request("an image_url part needs its url", param)
    if not url.startswith("data:"):
        raise bad_request(
            "only data: URLs are read (data:image/png;base64,...): the server fetches no "
            "image from the network",
            param,
        )
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise bad_request("an image's data: URL must be base64 (data:image/png;base64,...)", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the image's data: URL holds invalid base64", param) from None
    if not data:
        raise bad_request("the image's data: URL is empty", param)
    return data


def place_images(
    prompt: list[int], images: list[bytes], vision: VisionSpec
) -> tuple[list[int], PromptImages]:
    """``prompt`` with each image token made its run of placeholders, and the images
    placed on the runs. A count that differs from the images (a text that spells the
    image token itself, a template that dropped an image) is a 400."""
    tokens, offsets = expand_placeholders(prompt, vision.image_token_id, vision.tokens_per_image)
    if len(offsets) != len(images):
        raise bad_request(
            f"the prompt holds {len(offsets)} image tokens (id {vision.image_token_id}) for "
            f"{len(images)} images: a text may not contain the image token itself",
            "messages",
        )
    messages = tuple(pb.Image(offset=o, data=d) for o, d in zip(offsets, images, strict=True))
    spans = tuple(
        ImageSpan(o, vision.tokens_per_image, image_digest(d))
        for o, d in zip(offsets, images, strict=True)
    )
    return tokens, PromptImages(messages, spans)
