"""Images' placement in prompts and their keys in block hashes (torch-free)."""

from __future__ import annotations

import pytest

from common.hashing import hash_blocks, transfer_block_hashes
from common.multimodal import (
    ImageSpan,
    ImageText,
    block_extra,
    check_image_spans,
    image_digest,
    image_offsets,
)

IMG = 9
LLAVA_TEXT = ImageText("<image>", "", "<image>", "", IMG, IMG, (), ())
# Gemma 3's: newlines (5), a start token (7) as the marker, the run, an end token (8).
GEMMA3_TEXT = ImageText("<boi>", "\n\n<boi>", "<img>", "<eoi>\n\n", 7, IMG, (5, 7), (8, 5))


def test_each_marker_becomes_its_images_sequence():
    assert LLAVA_TEXT.expand("a <image> b", [3]) == "a <image><image><image> b"
    assert GEMMA3_TEXT.expand("a<boi>b", [3]) == "a\n\n<boi><img><img><img><eoi>\n\nb"
    # Images of their own sizes (Qwen2.5-VL's dynamic resolution): counts in order.
    assert LLAVA_TEXT.expand("<image>-<image>", [1, 2]) == "<image>-<image><image>"
    assert LLAVA_TEXT.expand_ids([1, IMG, 2, IMG, IMG, 3], [3, 3, 3]) == [
        1, IMG, IMG, IMG, 2, IMG, IMG, IMG, IMG, IMG, IMG, 3,
    ]  # fmt: skip
    assert GEMMA3_TEXT.expand_ids([1, 7, 2], [3]) == [1, 5, 7, IMG, IMG, IMG, 8, 5, 2]
    assert image_offsets([1, 5, 7, IMG, IMG, IMG, 8, 5, 2], IMG, [3]) == [3]
    assert image_offsets([IMG, IMG, IMG, 2, IMG], IMG, [2, 1, 1]) == [0, 2, 4]  # adjacent
    with pytest.raises(ValueError, match="holds 1 image markers .* for 2 images"):
        LLAVA_TEXT.expand_ids([1, IMG, 2], [3, 3])
    with pytest.raises(ValueError, match="holds 2 '<boi>' markers for 1 images"):
        GEMMA3_TEXT.expand("<boi> and <boi>", [3])
    for runs, counts in (([1, IMG, IMG, IMG, IMG, 2], [3]),  # a spelled placeholder joins
                         ([1, IMG, IMG, IMG, 2, IMG, IMG, IMG], [3]),  # one run too many
                         ([IMG, IMG, 2], [3])):  # fmt: skip
        with pytest.raises(ValueError, match="are not its"):
            image_offsets(runs, IMG, counts)


def test_spans_must_cover_every_run_in_order():
    tokens, offsets = [1, *[IMG] * 8, 2, *[IMG] * 4], [1, 5, 10]
    spans = [ImageSpan(o, 4, image_digest(bytes([o]))) for o in offsets]
    assert check_image_spans(tokens, spans, IMG) is None  # adjacent runs split in 4s
    assert "are not its 2 images" in check_image_spans(tokens, spans[:2], IMG)
    assert "do not match" in check_image_spans(tokens, spans[::-1], IMG)
    assert "are not its" in check_image_spans(tokens[:-1], spans, IMG)
    sized = [ImageSpan(1, 5, b""), ImageSpan(6, 3, b""), ImageSpan(10, 4, b"")]
    assert check_image_spans(tokens, sized, IMG) is None  # images of their own sizes


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


def test_a_block_of_an_image_is_keyed_by_the_images_adjacent_to_it_too():
    """Adjacent images are one attention group where images attend both ways (Gemma 3):
    the blocks of the first depend on the second, so "[A][B]" and "[A][C]" must not
    share them. Images with text between stay apart."""
    a, b, c = image_digest(b"a"), image_digest(b"b"), image_digest(b"c")
    tokens = [1] * 4 + [IMG] * 16 + [2] * 4  # A at [4, 12), then B or C at [12, 20)
    with_b = [ImageSpan(4, 8, a), ImageSpan(12, 8, b)]
    with_c = [ImageSpan(4, 8, a), ImageSpan(12, 8, c)]
    hashes_b = hash_blocks(tokens, 4, images=with_b)
    hashes_c = hash_blocks(tokens, 4, images=with_c)
    assert hashes_b[0] == hashes_c[0] and hashes_b[1] != hashes_c[1]  # [4, 8): A alone
    assert block_extra(with_b, 4, 8) == (
        (0).to_bytes(8, "little", signed=True) + a + (8).to_bytes(8, "little", signed=True) + b
    )
    apart = [ImageSpan(4, 8, a), ImageSpan(13, 7, b)]  # a token between them
    assert block_extra(apart, 4, 8) == (0).to_bytes(8, "little", signed=True) + a
