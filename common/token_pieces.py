"""What one token reads as and stands for, for log-probs: its text where it stands after
other text, and its bytes.

A token decoded alone can read differently than in a sequence: a SentencePiece decoder
(Llama 2, Mistral) strips the space of a sequence's first token, so "▁the" alone is "the".
So the token is decoded twice in a row and the text of the first removed: " the", what
the token adds to a text (two copies of one token cannot form a character together that
neither is alone: a byte-fallback byte twice is no valid UTF-8). A token that is part of a
character (a byte of a CJK character or an emoji) decodes to U+FFFD; its bytes (OpenAI's
``bytes``, from which a client rebuilds characters split across tokens) come from the
vocabulary: GPT-2's byte-to-character map for byte-level vocabularies, ``<0xNN>`` for
SentencePiece's byte fallback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other bytes for characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


class TokenPieces:
    """``decode(ids, skip_special_tokens)`` and ``piece(id)`` (the vocabulary's string for
    the token) are the tokenizer's."""

    def __init__(
        self, decode: Callable[[Sequence[int], bool], str], piece: Callable[[int], str | None]
    ) -> None:
        self._decode = decode
        self._piece = piece
        self._byte_of = byte_level_map()

    def text(self, token_id: int) -> str:
        """The token's text where it follows other text (special tokens' text kept)."""
        alone = self._decode([token_id], False)
        twice = self._decode([token_id, token_id], False)
        return twice[len(alone) :] if twice.startswith(alone) else alone

    def bytes(self, token_id: int, text: str | None = None) -> bytes:
        """The bytes the token stands for: its text's, unless the text holds U+FFFD (part
        of a character), where the vocabulary's piece says which bytes. ``text``: its
        ``text``, when the caller has it already (two decodes each)."""
        text = self.text(token_id) if text is None else text
        if "\ufffd" not in text:
            return text.encode()
        piece = self._piece(token_id) or ""
        if match := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if piece and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        return text.encode()
