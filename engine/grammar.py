"""Each structured request's grammar state: which tokens may come next.

A request with ``SamplingParams.structured_output`` gets an llguidance matcher when it is
added. The matcher follows the request's output tokens, not its KV: tokens generated
elsewhere (the first token, sampled by a prefill worker; a sequence the router moved) are
replayed into it at admission, and a preemption that recomputes the KV leaves it as it is.
Before each sampling step the sampler masks every token the grammar does not allow; after
it the sampled token advances the matcher. A request whose grammar is complete (nothing
but EOS may follow) stops there, without a step spent sampling the EOS.

``prepare`` (compile, first mask, replay) is thread-safe and may run off the engine
thread, which a large schema would otherwise stall for every sequence in the batch;
``add``, ``allowed``, ``accept`` and the rest run on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.structured_output import (
    STRUCTURED_OUTPUT,
    GrammarCompiler,
    StructuredOutput,
    StructuredOutputError,
    first_line,
)
from engine.errors import InvalidRequestError


class Grammars:
    """The matchers of the structured requests in one engine, by request id."""

    def __init__(
        self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(model_dir, vocab_size, sorted(eos_token_ids))
        self._matchers: dict[str, Any] = {}  # request id -> llguidance.LLMatcher

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def warm_up(self) -> bool:
        """Build llguidance's tokenizer now (~1 s for a 128k vocabulary) rather than at
        the first structured request. False, and nothing raised, where structured outputs
        are unavailable (no llguidance, no tokenizer.json): requests then say why."""
        try:
            self.compiler.tokenizer()
        except StructuredOutputError:
            return False
        return True

    def prepare(self, structured: StructuredOutput, output_token_ids: Sequence[int]) -> Any:
        """A matcher for ``structured`` with ``output_token_ids`` replayed into it, for
        ``add``. Raises ``InvalidRequestError`` for a constraint that does not compile,
        and for tokens it does not allow or that already complete it. Any thread."""
        try:
            matcher = self.compiler.matcher(structured)
        except StructuredOutputError as error:
            raise InvalidRequestError(str(error), STRUCTURED_OUTPUT) from error
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise InvalidRequestError(
                f"output_token_ids do not follow the {structured.kind} constraint",
                "output_token_ids",
            )
        if output_token_ids and matcher.is_stopped():
            raise InvalidRequestError(
                f"output_token_ids already complete the {structured.kind} constraint: "
                "nothing is left to generate",
                "output_token_ids",
            )
        return matcher

    def add(self, request_id: str, matcher: Any) -> None:
        """Follow ``request_id`` with a matcher from ``prepare``."""
        self._matchers[request_id] = matcher

    def allowed(self, request_id: str) -> torch.Tensor:
        """Which tokens the grammar allows next: [vocab_size] bool, on the CPU. (numpy
        unpacks the bits in a third of the time torch's ops take: this runs per sampled
        token of every structured request.) All True once llguidance has given up on the
        grammar (a step over its limits): the step samples freely, ``accept`` refuses the
        token and the request ends with the error (an all-False row would leave the
        sampler nothing to draw from)."""
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)  # [W]
        matcher = self._matchers[request_id]
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if matcher.is_error():
            return torch.ones(self.vocab_size, dtype=torch.bool)
        # Bit i of word j allows token 32 * j + i: little-endian bytes, low bit first.
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def accept(self, request_id: str, token_id: int) -> str | None:
        """Advance the matcher by a sampled token. Returns why it failed, or None. With
        the sampler's masks a refusal means llguidance gave up on the grammar (a step
        over its limits): the constraint's fault, not the worker's."""
        matcher = self._matchers[request_id]
        if matcher.consume_token(token_id):
            return None
        return f"the structured output constraint failed: {first_line(matcher.get_error())}"

    def complete(self, request_id: str) -> bool:
        """Whether the grammar has ended: nothing but EOS may follow."""
        return self._matchers[request_id].is_stopped()

    def discard(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
