"""A token's text where it follows other text, and the bytes it stands for, on the two
vocabulary families whose tokens read differently alone: SentencePiece (the first space
stripped; ``<0xNN>`` byte tokens) and byte-level (a character and part of the next)."""

from __future__ import annotations

import pytest

from common.token_pieces import byte_level_map
from tests.common import made_tokenizers

TEXT = "Hello world, this is the 世界 test 😀"


@pytest.mark.parametrize("family", ["llama2_style", "byte_level"])
def test_pieces_join_to_the_text_and_the_bytes_rebuild_it(family, tmp_path):
    tokenizer = getattr(made_tokenizers, family)(tmp_path)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = tokenizer.pieces
    assert b"".join(pieces.bytes(t) for t in ids).decode().strip() == TEXT
    whole = [pieces.text(t) for t in ids if "\ufffd" not in pieces.text(t)]
    assert all(piece in " " + TEXT for piece in whole)
    if family == "llama2_style":
        the = tokenizer.token_id("▁the")
        assert tokenizer.decode([the]) == "the"  # alone, the decoder strips its space
        assert pieces.text(the) == " the" and pieces.bytes(the) == b" the"
        byte = tokenizer.token_id("<0xE4>")
        assert pieces.text(byte) == "\ufffd" and pieces.bytes(byte) == b"\xe4"
    else:
        (mixed,) = [t for t in range(tokenizer.vocab_size)
                    if tokenizer.convert_ids_to_tokens([t]) == ["ĠâĢ"]]  # fmt: skip
        assert pieces.text(mixed) == " \ufffd" and pieces.bytes(mixed) == b" \xe2\x80"


def test_the_demo_models_pieces_read_as_decoded_alone(tiny_llama):
    """A byte-level vocabulary whose tokens read the same alone: nothing changes there."""
    from common.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama)
    for token_id in range(0, tokenizer.vocab_size, 7):
        assert tokenizer.pieces.text(token_id) == tokenizer.decode(
            [token_id], skip_special_tokens=False
        )


def test_the_byte_level_alphabet_is_gpt2s():
    mapping = byte_level_map()
    assert len(mapping) == 256 and sorted(mapping.values()) == list(range(256))
    assert mapping["Ġ"] == ord(" ") and mapping["a"] == ord("a") and mapping["Ċ"] == ord("\n")
