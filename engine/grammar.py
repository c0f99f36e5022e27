"""Each structured request's grammar state: which tokens may come next.

A request with ``SamplingParams.structured_output`` gets an llguidance matcher when it is
added. The matcher follows the request's output tokens, not its KV: tokens generated
elsewhere (the first token, sampled by a prefill worker; a sequence the router moved) are
replayed into it at admission, and a preemption that recomputes the KV leaves it as it is.
Before each sampling step the sampler masks every token the grammar does not allow; after
it the sampled token advances the matcher. A request whose grammar is complete (nothing
but EOS may follow) stops there, without a step spent sampling the EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.structured_output import (
    StructuredOutput,
    StructuredOutputError,
    grammar_of,
    load_grammar_tokenizer,
    require_llguidance,
)
from engine.errors import InvalidRequestError

PARAM = "structured_output"
_GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (n > 1 and retries repeat one)


class Grammars:
    """The matchers of the structured requests in one engine, by request id."""

    def __init__(
        self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use
        self._compiled: dict[StructuredOutput, str] = {}
        self._matchers: dict[str, Any] = {}  # request id -> llguidance.LLMatcher

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def warm_up(self) -> bool:
        """Build llguidance's tokenizer now (~1 s for a 128k vocabulary) rather than on
        the engine thread at the first structured request, which would stall every
        sequence in the batch meanwhile. False, and nothing raised, where structured
        outputs are unavailable (no llguidance, no tokenizer.json): requests say why."""
        try:
            require_llguidance()
            if self._tokenizer is None:
                self._tokenizer = load_grammar_tokenizer(
                    self.model_dir, self.vocab_size, self.eos_token_ids
                )
        except StructuredOutputError:
            return False
        return True

    def add(
        self, request_id: str, structured: StructuredOutput, output_token_ids: Sequence[int]
    ) -> None:
        """Start ``request_id``'s matcher and replay ``output_token_ids`` into it. Raises
        ``InvalidRequestError`` (nothing kept) for a constraint that does not compile, and
        for tokens it does not allow or that already complete it."""
        try:
            llguidance = require_llguidance()
            if self._tokenizer is None:
                self._tokenizer = load_grammar_tokenizer(
                    self.model_dir, self.vocab_size, self.eos_token_ids
                )
            grammar = self._grammar(structured)
        except StructuredOutputError as error:
            raise InvalidRequestError(str(error), PARAM) from error
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {structured.kind} constraint: "
                                      f"{matcher.get_error()}", PARAM)  # fmt: skip
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise InvalidRequestError(
                f"output_token_ids do not follow the {structured.kind} constraint: "
                f"{matcher.get_error()}",
                "output_token_ids",
            )
        if output_token_ids and matcher.is_stopped():
            raise InvalidRequestError(
                f"output_token_ids already complete the {structured.kind} constraint: "
                "nothing is left to generate",
                "output_token_ids",
            )
        self._matchers[request_id] = matcher

    def _grammar(self, structured: StructuredOutput) -> str:
        grammar = self._compiled.get(structured)
        if grammar is None:
            grammar = grammar_of(structured)
            if len(self._compiled) >= _GRAMMAR_CACHE_SIZE:
                del self._compiled[next(iter(self._compiled))]  # the oldest
            self._compiled[structured] = grammar
        return grammar

    def allowed(self, request_id: str) -> torch.Tensor:
        """Which tokens the grammar allows next: [vocab_size] bool, on the CPU. (numpy
        unpacks the bits in a third of the time torch's ops take: this runs per sampled
        token of every structured request.)"""
        words = np.empty((self.vocab_size + 31) // 32, dtype=np.uint32)  # [W]
        self._matchers[request_id].unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        # Bit i of word j allows token 32 * j + i: little-endian bytes, low bit first.
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def accept(self, request_id: str, token_id: int) -> str | None:
        """Advance the matcher by a sampled token. Returns why it refused the token (the
        sampler's masks make that a bug, not an input error), or None."""
        matcher = self._matchers[request_id]
        if matcher.consume_token(token_id):
            return None
        return f"token {token_id} breaks the structured output constraint: {matcher.get_error()}"

    def complete(self, request_id: str) -> bool:
        """Whether the grammar has ended: nothing but EOS may follow."""
        return self._matchers[request_id].is_stopped()

    def discard(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
