"""What a profile measures: prompt lengths, decode batches and contexts, and how long.
Torch-free: both profilers (the engine's, ``planner/profiler.py``; a running stack's,
``planner/stack_profiler.py``) take it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from planner.profile_data import EngineFacts

Progress = Callable[[str], None]
KV_HEADROOM = 0.9  # of the pool a decode measurement fills at most


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure. Empty tuples: the defaults for the engine (``for_engine``)."""

    isls: tuple[int, ...] = ()
    batches: tuple[int, ...] = ()
    contexts: tuple[int, ...] = ()
    warmup_steps: int = 3
    measured_steps: int = 12
    repeats: int = 3  # a lone prompt's latency: the median of this many

    def __post_init__(self) -> None:
        for key in ("isls", "batches", "contexts"):
            if any(value < 1 for value in getattr(self, key)):
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup_steps < 0 or self.measured_steps < 1 or self.repeats < 1:
            raise ValueError("warmup_steps must be >= 0, measured_steps and repeats >= 1")

    @property
    def steps_per_batch(self) -> int:
        return self.warmup_steps + self.measured_steps

    def for_engine(self, facts: EngineFacts) -> Grid:
        """This grid with its empty axes filled for ``facts``: prompt lengths 128 x 4^k and
        contexts 256 x 4^k below the model's context, each with the longest that fits;
        batches 1, 2, 4, ... up to ``max_num_seqs``."""
        longest_isl = facts.max_model_len - 1
        isls = self.isls or _geometric(128, longest_isl)
        batches = self.batches or tuple(
            sorted({*(2**k for k in range(facts.max_num_seqs.bit_length())), facts.max_num_seqs})
        )
        longest_context = facts.max_model_len - self._drift(len(batches))
        contexts = self.contexts or _geometric(256, longest_context)
        return Grid(isls, batches, contexts, self.warmup_steps, self.measured_steps,
                    self.repeats)  # fmt: skip

    def _drift(self, num_batches: int) -> int:
        """How far past its mean a context grows over one context's measurements."""
        return math.ceil(num_batches * self.steps_per_batch / 2) + 1


def _geometric(start: int, longest: int) -> tuple[int, ...]:
    values = []
    value = start
    while value < longest:
        values.append(value)
        value *= 4
    if longest >= 1 and (not values or longest > values[-1] * 1.5):
        values.append(longest)  # the longest that fits, where the series stops well short
    return tuple(values)


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """How one context's decode points are measured: at ``context`` (the one asked, or the
    longest that fits), prompts of ``prompt_len`` tokens, these ``batches`` (largest first)."""

    context: int
    prompt_len: int
    batches: list[int]


def decode_run(
    facts: EngineFacts,
    batches: list[int],
    context: int,
    before: int,
    max_tokens: int,
    progress: Progress,
) -> DecodeRun | None:
    """A profiler's requests decode ``max_tokens`` each, ``before`` of them before their
    mean context: where that context is measured, their prompts, the batches that fit
    (``context_that_fits``, ``fitting_batches``); None if none does."""
    fitted = context_that_fits(facts, context, max_tokens - before, progress)
    if fitted is None:
        return None
    prompt_len = max(1, fitted - before)
    fitting = fitting_batches(facts, batches, fitted, prompt_len + max_tokens, progress)
    return DecodeRun(fitted, prompt_len, fitting) if fitting else None


def context_that_fits(
    facts: EngineFacts, context: int, overshoot: int, progress: Progress
) -> int | None:
    """``context``, or where its measurement's requests, running ``overshoot`` tokens past
    their mean context, would pass ``max_model_len``, the longest context that fits (said);
    None if none does."""
    longest = facts.max_model_len - overshoot
    if context <= longest:
        return context
    if longest < 1:
        progress(f"decode context {context}: skipped, its requests would pass "
                 f"max_model_len ({facts.max_model_len})")  # fmt: skip
        return None
    progress(f"decode context {context}: measured at {longest}, the longest whose requests "
             f"stay within max_model_len ({facts.max_model_len})")  # fmt: skip
    return longest


def fitting_batches(
    facts: EngineFacts, batches: list[int], context: int, end_len: int, progress: Progress
) -> list[int]:
    """Of ``batches``, those whose requests, ``end_len`` tokens long at their end, the KV
    pool (at ``KV_HEADROOM``) and ``max_num_seqs`` hold; those left out are said. None if
    ``end_len`` passes the model's context."""
    fits = int(facts.kv_capacity_tokens * KV_HEADROOM) // (end_len + facts.block_size)
    limit = min(fits, facts.max_num_seqs)
    fitting = [b for b in batches if b <= limit]
    if len(fitting) < len(batches):
        progress(f"decode context {context}: batches above {limit} do not fit (KV pool, "
                 "max_num_seqs)")  # fmt: skip
    return fitting if end_len <= facts.max_model_len else []


def loaded_prompt_count(facts: EngineFacts, isl: int, minimum: int) -> int:
    """Prompts of ``isl`` tokens sent at once to time a loaded worker: enough to fill at
    least three steps, at least ``minimum``, no more than the KV pool holds."""
    fits = int(facts.kv_capacity_tokens * KV_HEADROOM) // (isl + facts.block_size)
    return max(1, min(max(minimum, math.ceil(3 * facts.max_num_batched_tokens / isl) + 1), fits))
