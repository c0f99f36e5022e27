"""How to pick each next token, and when to stop."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.structured_output import STRUCTURED_OUTPUT, StructuredOutput
from engine.errors import InvalidSamplingParamsError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class BadWordIndex:
    """Bad words by the length of their prefix (all but the last token), each length's
    prefixes -> the last tokens they ban, and the set of its prefixes' last tokens. The
    sampler asks at every step of every sequence: going over every word cost 13 ms a
    sequence a step with 4096 long ones (a request's allowance), and a request of 16
    such sequences stalled its decode worker past the router's 10 s (a security audit,
    2026-12-02). Now a step looks up each prefix length once, and only where the
    output's last token ends one of its prefixes."""

    always: tuple[int, ...]  # one-token words: banned at every step
    by_length: tuple[tuple[int, frozenset[int], Mapping[tuple[int, ...], tuple[int, ...]]], ...]

    @classmethod
    def of(cls, words: Sequence[Sequence[int]]) -> BadWordIndex:
        tables: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in words:
            if len(word) > 1:
                table = tables.setdefault(len(word) - 1, {})
                table.setdefault(tuple(word[:-1]), []).append(word[-1])
        by_length = tuple(
            (length, frozenset(prefix[-1] for prefix in table),
             {prefix: tuple(last) for prefix, last in table.items()})
            for length, table in sorted(tables.items())
        )  # fmt: skip
        return cls(tuple(word[0] for word in words if len(word) == 1), by_length)

    def bans(self, output_token_ids: Sequence[int]) -> list[int]:
        bans = list(self.always)
        if len(output_token_ids) == 0 or not self.by_length:
            return bans
        last, num_tokens = output_token_ids[-1], len(output_token_ids)
        for length, lasts, table in self.by_length:
            if length > num_tokens:
                break
            if last in lasts:
                bans += table.get(tuple(output_token_ids[-length:]), ())
        return bans


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings. ``temperature == 0`` means greedy.

    ``max_tokens`` None means "until max_model_len". ``top_k`` 0 or -1 disables top-k.
    ``seed`` makes the request's random choices reproducible whatever it is batched with.
    ``logprobs`` is the number of top log-probs returned per sampled token (None: none;
    0: only the sampled token's own). Log-probs are of the model's raw distribution,
    before penalties, temperature, min-p, top-k and top-p. ``prompt_logprobs`` likewise
    scores each prompt token after the first (what lm-eval's loglikelihood tasks read); a
    request with it computes its whole prompt, whatever the prefix cache holds.

    Penalties, with vLLM's and OpenAI's meanings: ``repetition_penalty`` (1: off) divides
    positive logits and multiplies negative ones of every token in the prompt or the
    output (as transformers); ``frequency_penalty`` subtracts itself times each token's
    count in the output, ``presence_penalty`` itself once per token in the output.
    ``min_p`` (0: off) drops tokens less likely than ``min_p`` times the likeliest one,
    after temperature.

    ``logit_bias`` (OpenAI's: token id -> a bias in [-100, 100], given as a mapping or as
    pairs, kept as pairs) is added to those tokens' logits, and
    ``allowed_token_ids`` (vLLM's; None: all) is the only tokens that may be sampled; both
    apply before penalties, greedy included (vLLM's order), and not to log-probs.
    ``bad_words_token_ids`` (vLLM's ``bad_words``, tokenized) are token sequences that may
    not be generated: a sequence's last token is banned whenever the output so far ends
    with the rest of it (a one-token sequence is always banned).

    ``structured_output`` (None: free text) is what the output must match: a JSON schema,
    a regex, a choice or a grammar (``common/structured_output.py``). It outranks the
    bans, allowed tokens and bad words: where they would leave nothing the grammar allows
    (EOS banned by ``min_tokens`` where only EOS completes it), only the grammar applies;
    and once the output is complete (nothing but EOS may follow) the request stops there,
    whatever ``min_tokens`` and ``ignore_eos`` say.

    ``n``, ``stop`` and ``include_stop_str_in_output`` are the offline API's
    (``engine/llm.py``, vLLM's meanings): ``n`` samples of the prompt, text stop strings
    (the sequence ends at the first to appear, its text cut before it unless
    ``include_stop_str_in_output``). An engine request is one sequence and reads no text:
    ``LLMEngine.add_request`` refuses them (the router applies its requests' own).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_output: StructuredOutput | None = None
    n: int = 1
    stop: str | Sequence[str] | None = ()
    include_stop_str_in_output: bool = False
    # ``bad_words_token_ids`` indexed for ``bad_word_bans`` (made in ``__post_init__``).
    _bad_words: BadWordIndex = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", tuple(dict.fromkeys(stop)))
        # Lists without repeats (order kept): the sampler goes over them at every step,
        # and a request repeating one id millions of times slowed every batch it was in.
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        object.__setattr__(self, "logit_bias", tuple(dict(self.logit_bias).items()))
        if self.allowed_token_ids is not None:
            allowed = tuple(dict.fromkeys(self.allowed_token_ids))
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(dict.fromkeys(tuple(word) for word in self.bad_words_token_ids))
        object.__setattr__(self, "bad_words_token_ids", words)
        self._validate()
        object.__setattr__(self, "_bad_words", BadWordIndex.of(words))

    def _check_types(self) -> None:
        """Counts are integers (a numpy one is made an int), not booleans; the rest are
        numbers. Past the range checks, ``logprobs=1.5`` or ``top_k=2.5`` failed inside a
        step, taking the requests batched with it down too, and ``max_tokens=2.5`` gave
        3 tokens."""
        for name in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
                     "n"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
                continue
            if not _is_integer(value):
                raise InvalidSamplingParamsError(f"{name} must be an integer, got {value!r}", name)
            object.__setattr__(self, name, int(value))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidSamplingParamsError(f"{name} must be a number, got {value!r}", name)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool | np.bool_):
                raise InvalidSamplingParamsError(
                    f"{name} must be true or false, got {value!r}", name
                )
            object.__setattr__(self, name, bool(value))

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(f"{param} {message}", param)

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", f"must fit in 64 bits, got {self.seed}")
        if any(not _is_integer(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails too
                raise bad(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:  # NaN fails too
            raise bad(
                "repetition_penalty", f"must be > 0 and finite, got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for token_id, bias in self.logit_bias:
            if not _is_integer(token_id) or token_id < 0:
                raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {token_id!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty")
            if any(not _is_integer(t) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be non-negative integers")
        for word in self.bad_words_token_ids:
            if not word or any(not _is_integer(t) or t < 0 for t in word):
                raise bad("bad_words", "must be non-empty sequences of token ids")
        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise bad(STRUCTURED_OUTPUT, "must be a StructuredOutput")

    def bad_word_bans(self, output_token_ids: Sequence[int]) -> list[int]:
        """The last tokens of the bad words whose other tokens end ``output_token_ids``."""
        return self._bad_words.bans(output_token_ids)

    def ids_banned_before_min_tokens(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """What may not be sampled while fewer than ``min_tokens`` were generated: the
        stop token ids and EOS, with ``ignore_eos`` too (as in vLLM, whose min_tokens
        bans every id it knows as a stop: benchmarks ask for exact lengths with both
        set, and got the EOS ids among their first tokens here, unlike there)."""
        return frozenset(self.stop_token_ids) | eos_token_ids

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _is_integer(value: object) -> bool:
    """An integer (Python's or numpy's), not a boolean."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
