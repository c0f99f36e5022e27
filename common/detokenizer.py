"""Incremental detokenization and stop strings, per generated sequence.

Text is decoded from a sliding window of tokens (as vLLM does), so each new token costs
O(window), and characters still incomplete (a multi-byte character split across tokens
shows up as U+FFFD) are held back until complete. Stop strings are matched on the text;
the text that could still be the start of a stop string is held back too, so a stream
never shows the client part of a stop string.

The first tokens are decoded after the prompt's last few (``context``), as vLLM does, so
a completion keeps what it owes to them: with a SentencePiece tokenizer whose decoder strips
the first space (Llama 2, Mistral), a completion " the" decoded alone came out "the", and
prompt + completion was "... isthe".

Stop strings are not looked for in the text of the first ``min_tokens`` tokens (a match may
still begin there and end after), as in vLLM: ``min_tokens`` means "at least this many",
and the engine likewise keeps EOS and stop token ids from ending the sequence earlier.

The text is kept as finished pieces and a live tail (what a stop string may still cut and
what is not yet handed out): appending to one string copied the whole text every token,
quadratic in the reply (2.5 s of copying for a 64k-token reply, on the router's loop).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.tokenizer import Tokenizer

_WINDOW = 6  # tokens of left context decoded with the new ones
_LIVE_CHARS = 4096  # finished text moved out of the live tail this many characters at a time


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0,
                 keep_special: frozenset[int] = frozenset(), include_stop: bool = False,
                 skip_special: bool = True, context: Sequence[int] = ()) -> None:  # fmt: skip
        """``context``: the prompt's token ids (its last ``_WINDOW`` are used).
        ``keep_special``: special tokens whose text is kept (the others are dropped),
        for a format the router reads from the text (``router/harmony.py``, Mistral's
        tool calls); a stop string never matches inside one. ``include_stop`` (vLLM's
        ``include_stop_str_in_output``): the text ends with the stop string that
        matched, not before it; what followed it is cut either way. ``skip_special``
        (vLLM's ``skip_special_tokens``) False: every special token's text is kept, the
        markers' too, and stop strings match in it as in any text."""
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.keep_special = keep_special
        self.skip_special = skip_special
        self._markers = [tokenizer.decode([t], skip_special_tokens=False) for t in keep_special]
        self._marker_len = max((len(m) for m in self._markers), default=0)
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._search_from = 0  # characters of ``text`` before the first min_tokens ended
        self.token_ids: list[int] = []  # the generated ones
        # The ids decoded: the context, then ``token_ids``; offsets index this.
        self._ids = self._usable_context(context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # ``text`` (everything decoded so far; once stopped, up to the stop string) is
        # ``_head`` joined, then ``_live``, which starts at character ``_base``.
        self._head: list[str] = []
        self._live = ""
        self._base = 0
        self._emitted = 0  # characters of ``text`` already handed out
        self.stopped = False
        self.stop_string: str | None = None

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is safe to show."""
        if self.stopped:
            return ""
        # One token at a time, so that the text does not depend on how the tokens were
        # grouped (speculative drafts, the first token with the next, a slow reader's
        # merged outputs): decoded together, an incomplete character at the end held back
        # every character before it, so the exempt text of the first min_tokens ended
        # late and a stop string matched inside it; and of two stop strings the one that
        # began first won, not the one completed first, as token by token.
        if not self.stop:  # nothing to find: the same text, decoded in one go
            self._decode(token_ids)
            return self._take(final=False)
        for token_id in token_ids:
            self._decode([token_id])
            if len(self.token_ids) == self.min_tokens:
                self._search_from = self._length()
            self._check_stop()
            if self.stopped:
                break
        return self._take(final=False)

    @property
    def text(self) -> str:
        """Everything decoded so far (once stopped, up to the stop string)."""
        if self._head:  # joined once, kept joined
            self._live = "".join(self._head) + self._live
            self._head.clear()
            self._base = 0
        return self._live

    def _length(self) -> int:
        return self._base + len(self._live)

    def _append(self, piece: str) -> None:
        """Add ``piece`` to the text; move what no stop string can cut any more (before
        the handed-out text's last ``_hold`` characters and a marker's length) to the
        finished pieces, once the live tail is long."""
        self._live += piece
        keep_from = self._emitted - self._hold - self._marker_len - self._base
        if keep_from > _LIVE_CHARS:
            self._head.append(self._live[:keep_from])
            self._live = self._live[keep_from:]
            self._base += keep_from

    def _usable_context(self, context: Sequence[int]) -> list[int]:
        """The prompt's last ids, unless they end inside a character (a prompt given as
        token ids may): the generated bytes would complete it, and the text would hold
        a character the prompt began. A window that starts inside a character is
        widened (to 4 windows): a byte-fallback decoder (Llama 2, Mistral) reads a whole
        run of byte tokens that starts mid-character as replacement characters, so a
        prompt ending in two emoji seemed to end inside one, the context was dropped,
        and the reply lost its first space (an audit: "Hello 😀😀the test")."""
        for width in range(_WINDOW, 4 * _WINDOW + 1, _WINDOW):
            tail = list(context[-width:])
            if not self._decode_ids(tail).endswith("\ufffd"):
                return tail
            if width >= len(context):
                break
        return []

    def _decode(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        self._ids.extend(token_ids)
        prefix = self._decode_ids(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode_ids(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix) :])
            self._prefix_offset = max(len(self._ids) - _WINDOW, self._read_offset)
            self._read_offset = len(self._ids)

    def _decode_ids(self, token_ids: Sequence[int]) -> str:
        if not self.skip_special:
            return self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return self.tokenizer.decode(token_ids, keep_special=self.keep_special)

    def finish(self) -> str:
        """The rest of the text once the sequence ended."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix = self._decode_ids(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode_ids(self._ids[self._prefix_offset :])
            self._append(full[len(prefix) :])
            self._read_offset = len(self._ids)
            self._check_stop()
        return self._take(final=True)

    def _check_stop(self) -> None:
        if not self.stop or self.stopped or len(self.token_ids) <= self.min_tokens:
            return
        # A match must end after the text already searched (and after the first
        # min_tokens' text): each stop string may begin len(s) - 1 characters before it.
        # One start for all (the longest's) let a short one match inside the exempt text.
        searched = max(self._emitted, self._search_from)
        # Searched from ``text[base:]``: a match begins at most ``_hold`` characters
        # before ``searched``, and kept markers are blanked in a window a marker longer.
        base = max(searched - self._hold - self._marker_len, self._base)
        text = self._live[base - self._base :]
        if self._markers and self.skip_special:  # kept markers (Harmony) are no text
            for marker in self._markers:
                text = text.replace(marker, "\0" * len(marker))
        found = [(text.find(s, max(searched - len(s) + 1 - base, 0)), s) for s in self.stop]
        # The first to begin; of two beginning together, the first listed (as vLLM
        # checks them), not the first in alphabetical order.
        found = [(i + base, order, s) for order, (i, s) in enumerate(found) if i >= 0]
        if found:
            index, _, stop = min(found)
            end = index + len(stop) if self.include_stop else index
            self._live = self._live[: end - self._base]
            self.stopped = True
            self.stop_string = stop

    def _take(self, final: bool) -> str:
        length = self._length()
        end = length if final or self.stopped else max(length - self._hold, 0)
        end = max(end, self._emitted)
        piece = self._live[self._emitted - self._base : end - self._base]
        self._emitted = end
        return piece
