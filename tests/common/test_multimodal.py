"""Images' placement in prompts and their keys in block hashes (torch-free)."""

from __future__ import annotations

import pytest

from common.hashing import hash_blocks, transfer_block_hashes
from common.multimodal import (
    ImageSpan,
    block_extra,
    check_image_spans,
    expand_placeholders,
    image_digest,
)

IMG = 9


def test_each_image_token_becomes_its_run():
    assert expand_placeholders([1, IMG, 2, IMG, IMG, 3], IMG, 3) == (
        [1, IMG, IMG, IMG, 2, IMG, IMG, IMG, IMG, IMG, IMG, 3],
        [1, 5, 8],
    )
    with pytest.raises(ValueError, match="holds 1 image tokens .* for 2 images"):
        expand_placeholders([1, IMG, 2], IMG, 3, num_images=2)


def test_spans_must_cover_every_run_in_order():
    tokens, offsets = expand_placeholders([1, IMG, IMG, 2, IMG], IMG, 4)
    spans = [ImageSpan(o, 4, image_digest(bytes([o]))) for o in offsets]
    assert check_image_spans(tokens, spans, IMG, 4) is None  # adjacent runs split in 4s
    assert "do not match" in check_image_spans(tokens, spans[:2], IMG, 4)
    assert "do not match" in check_image_spans(tokens, spans[::-1], IMG, 4)
    assert "takes 4" in check_image_spans(tokens[:-1], spans, IMG, 4)


def test_blocks_are_keyed_by_the_images_they_overlap():
    """Text-only blocks keep their hashes; a block with an image is keyed by its digest
    and place; extending hashes block by block (``first_position``) gives the same."""
    a, b = image_digest(b"a"), image_digest(b"b")
    tokens = [1] * 4 + [IMG] * 6 + [2] * 6  # blocks of 4: [0,4) text, then the image
    with_a = [ImageSpan(4, 6, a)]
    with_b = [ImageSpan(4, 6, b)]
    plain = hash_blocks(tokens, 4)
    hashes_a, hashes_b = (
        hash_blocks(tokens, 4, images=with_a),
        hash_blocks(tokens, 4, images=with_b),
    )
    assert hashes_a[0] == hashes_b[0] == plain[0]
    assert hashes_a[1] != hashes_b[1] and hashes_a[1] != plain[1]
    assert hashes_a[3] != hashes_b[3]  # the chain carries the difference on
    assert block_extra(with_a, 8, 12) == (-4).to_bytes(8, "little", signed=True) + a
    assert block_extra(with_a, 12, 16) is None
    tail = hash_blocks(tokens[8:], 4, parent_hash=hashes_a[1], images=with_a, first_position=8)
    assert tail == hashes_a[2:]
    names = transfer_block_hashes(tokens[:14], 4, images=with_a)
    assert names[:3] == hashes_a[:3] and len(names) == 4
    assert names[3] != transfer_block_hashes(tokens[:14], 4)[3]
