"""Draft tokens for speculative decoding by n-gram lookup ("prompt lookup decoding").

A sequence that repeats its context (code being edited, a document being quoted, a list
being reformatted) tends to go on the way it went the last time its latest tokens appeared.
The proposer finds the sequence's last ``max_n`` .. ``min_n`` tokens (the longest that
matches) at their most recent earlier occurrence and proposes the tokens that followed
there. The engine verifies them in the next forward pass (``engine/sampler.py``), so a bad
guess costs compute, never correctness.

Torch-free. Each request keeps its tokens in a growing numpy array (``TokenHistory``),
extended by what it appended since the last lookup, so a lookup is a vectorised scan of
the sequence with no Python loop over its tokens and no copy of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.request import Request


class DraftProposer(Protocol):
    """Guesses a decoding request's next tokens; the engine verifies them. Called on the
    engine thread once per step and request, so it must be cheap."""

    def propose(self, request: Request, max_drafts: int) -> list[int]: ...


class ModelDraftProposer:
    """``DraftProposer`` of the drafts a model (the MTP layer, or the draft model)
    proposed after the request's last step (``engine/mtp_drafts.py``); none if the
    request changed since (a preemption)."""

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return request.current_model_drafts[:max_drafts]


class NgramProposer:
    """``DraftProposer`` by n-gram lookup in the request's own tokens (``propose_ngram``)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        if request.token_history is None:
            request.token_history = TokenHistory()
        tokens = request.token_history.sync(request.prompt_token_ids, request.output_token_ids)
        return propose_ngram(tokens, self.min_n, self.max_n, max_drafts)


class TokenHistory:
    """A request's prompt and output tokens as one int64 array, grown as it generates."""

    __slots__ = ("buffer", "length")

    def __init__(self) -> None:
        self.buffer = np.empty(0, dtype=np.int64)
        self.length = 0  # tokens copied into the buffer so far

    def sync(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> np.ndarray:
        """The request's tokens (a view, valid until the next ``sync``): only the tokens
        appended since the last call are copied. Tokens are never taken back."""
        num_prompt = len(prompt_token_ids)
        total = num_prompt + len(output_token_ids)
        assert total >= self.length, "a request's tokens only grow"
        if total > self.buffer.size:
            grown = np.empty(max(total, 2 * self.buffer.size, 64), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        if self.length < num_prompt:
            self.buffer[self.length : num_prompt] = prompt_token_ids[self.length :]
            self.length = num_prompt
        self.buffer[self.length : total] = output_token_ids[self.length - num_prompt :]
        self.length = total
        return self.buffer[:total]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """Up to ``max_drafts`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``tokens`` of ``min_n`` .. ``max_n`` tokens; [] when none occurs.

    tokens: [num_tokens] int64. Matches are grown one token back at a time over the
    candidates left (positions holding the last token), so the cost is one O(num_tokens)
    comparison plus O(candidates) per extra token of match length."""
    num_tokens = len(tokens)
    if max_drafts <= 0 or num_tokens <= min_n:
        return []
    ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[num_tokens - 1])  # match ends
    if ends.size == 0:
        return []
    match_len = 1
    for n in range(2, min(max_n, num_tokens - 1) + 1):
        longer = ends[ends >= n - 1]
        longer = longer[tokens[longer - (n - 1)] == tokens[num_tokens - n]]
        if longer.size == 0:
            break
        ends, match_len = longer, n
    if match_len < min_n:
        return []
    end = int(ends[-1])  # the most recent occurrence: repetition tends to be local
    return tokens[end + 1 : end + 1 + max_drafts].tolist()
