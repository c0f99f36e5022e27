"""Incremental detokenization and stop strings, per generated sequence.

Text is decoded from a sliding window of tokens (as vLLM does), so each new token costs
O(window), and characters still incomplete (a multi-byte character split across tokens
shows up as U+FFFD) are held back until complete. Stop strings are matched on the text;
the text that could still be the start of a stop string is held back too, so a stream
never shows the client part of a stop string.

Stop strings are not looked for in the text of the first ``min_tokens`` tokens (a match may
still begin there and end after), as in vLLM: ``min_tokens`` means "at least this many",
and the engine likewise keeps EOS and stop token ids from ending the sequence earlier.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.tokenizer import Tokenizer

_WINDOW = 6  # tokens of left context decoded with the new ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0,
                 keep_special: frozenset[int] = frozenset(), include_stop: bool = False,
                 skip_special: bool = True) -> None:  # fmt: skip
        """``keep_special``: special tokens whose text is kept (the others are dropped),
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
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # everything decoded so far (once stopped, up to the stop string)
        self._emitted = 0  # characters of ``text`` already handed out
        self.stopped = False
        self.stop_string: str | None = None

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is safe to show."""
        if self.stopped:
            return ""
        exempt = max(self.min_tokens - len(self.token_ids), 0)  # tokens that may not stop
        if exempt:
            self._decode(token_ids[:exempt])
            self._search_from = len(self.text)
            token_ids = token_ids[exempt:]
        if token_ids:
            self._decode(token_ids)
            self._check_stop()
        return self._take(final=False)

    def _decode(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        prefix = self._decode_ids(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode_ids(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = max(len(self.token_ids) - _WINDOW, self._read_offset)
            self._read_offset = len(self.token_ids)

    def _decode_ids(self, token_ids: Sequence[int]) -> str:
        if not self.skip_special:
            return self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return self.tokenizer.decode(token_ids, keep_special=self.keep_special)

    def finish(self) -> str:
        """The rest of the text once the sequence ended."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            prefix = self._decode_ids(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode_ids(self.token_ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
            self._check_stop()
        return self._take(final=True)

    def _check_stop(self) -> None:
        if not self.stop or self.stopped or len(self.token_ids) <= self.min_tokens:
            return
        # A match must end after the text already searched (and after the first
        # min_tokens' text): each stop string may begin len(s) - 1 characters before it.
        # One start for all (the longest's) let a short one match inside the exempt text.
        searched = max(self._emitted, self._search_from)
        text = self.text
        if self._markers and self.skip_special:  # kept markers (Harmony) are no text
            start = max(searched - self._hold - self._marker_len, 0)
            window = text[start:]
            for marker in self._markers:
                window = window.replace(marker, "\0" * len(marker))
            text = text[:start] + window
        found = [(text.find(s, max(searched - len(s) + 1, 0)), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            index, stop = min(found)
            self.text = self.text[: index + len(stop) if self.include_stop else index]
            self.stopped = True
            self.stop_string = stop

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else max(len(self.text) - self._hold, 0)
        end = max(end, self._emitted)
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece
