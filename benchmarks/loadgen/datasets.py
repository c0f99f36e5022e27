"""Datasets by name: synthetic (random, prefix-repetition, multi-turn) and trace replays
(mooncake, azure, in ``traces.py``). Every builder is a pure function of its spec and token
source, so a run can be rebuilt exactly from its report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from benchmarks.loadgen.spec import DATASETS, DatasetSpec
from benchmarks.loadgen.tokens import TokenSource
from benchmarks.loadgen.workload import Session, Turn, Workload

__all__ = ["DATASETS", "DatasetSpec", "build_workload"]


Builder = Callable[[DatasetSpec, TokenSource], list[Session]]


def lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> list[int]:
    """``count`` lengths uniform in ``[mean*(1-r), mean*(1+r)]`` (integers, at least 1)."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count).tolist()


def random_dataset(spec: DatasetSpec, tokens: TokenSource) -> list[Session]:
    """Independent prompts of random tokens: no two share a cached block."""
    rng, shapes = tokens.stream(1), tokens.shape_stream(1)
    n = spec.num_requests
    ins = lengths(shapes, spec.input_len, spec.range_ratio, n)
    outs = lengths(shapes, spec.output_len, spec.range_ratio, n)
    return [Session(i, (Turn(tokens.draw(rng, ins[i]), outs[i]),)) for i in range(n)]


def prefix_repetition_dataset(spec: DatasetSpec, tokens: TokenSource) -> list[Session]:
    """Each prompt is one of ``num_prefixes`` shared prefixes (``prefix_len`` tokens, chosen
    at random) followed by a fresh suffix of ``input_len`` tokens: a prefix-cache workload
    (system prompts, few-shot examples)."""
    rng, shapes = tokens.stream(2), tokens.shape_stream(2)
    prefixes = [tokens.draw(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
    n = spec.num_requests
    choice = shapes.integers(0, spec.num_prefixes, size=n).tolist()
    ins = lengths(shapes, spec.input_len, spec.range_ratio, n)
    outs = lengths(shapes, spec.output_len, spec.range_ratio, n)
    return [
        Session(i, (Turn(prefixes[choice[i]] + tokens.draw(rng, ins[i]), outs[i]),))
        for i in range(n)
    ]


def multi_turn_dataset(spec: DatasetSpec, tokens: TokenSource) -> list[Session]:
    """Conversations of ``turns`` turns, ``input_len`` new user tokens each; the history
    (earlier prompts and the replies actually generated) is resent with every turn, so
    every turn after the first should hit the cache. The last conversation is shortened
    so that the total is ``num_requests`` requests."""
    rng, shapes = tokens.stream(3), tokens.shape_stream(3)
    sessions = []
    remaining = spec.num_requests
    while remaining > 0:
        count = min(spec.turns, remaining)
        ins = lengths(shapes, spec.input_len, spec.range_ratio, count)
        outs = lengths(shapes, spec.output_len, spec.range_ratio, count)
        turns = tuple(Turn(tokens.draw(rng, ins[k]), outs[k]) for k in range(count))
        sessions.append(Session(len(sessions), turns, think_time_s=spec.think_time_s))
        remaining -= count
    return sessions


def _fit_turns(
    session: Session, spec: DatasetSpec, max_model_len: int | None
) -> tuple[Session, bool]:
    """Apply the caps, then keep the session within the context window: a single turn's
    prompt keeps its leading tokens (so prefix structure survives); a conversation drops
    the turns that no longer fit. Returns the session and whether it changed."""
    turns = []
    for turn in session.turns:
        new = turn.new_tokens[: spec.max_input_tokens] if spec.max_input_tokens else turn.new_tokens
        out = min(turn.output_tokens, spec.max_output_tokens or turn.output_tokens)
        turns.append(Turn(new, out))
    if max_model_len is not None:
        context, kept = 0, []
        for turn in turns:
            if context + len(turn.new_tokens) + turn.output_tokens > max_model_len:
                if kept:
                    break
                out = min(turn.output_tokens, max_model_len // 2)
                turn = Turn(turn.new_tokens[: max_model_len - out], out)
            kept.append(turn)
            context += len(turn.new_tokens) + turn.output_tokens
        turns = kept
    fitted = replace(session, turns=tuple(turns))
    return fitted, fitted.turns != session.turns


def _builders() -> dict[str, Builder]:
    from benchmarks.loadgen.traces import azure_dataset, mooncake_dataset

    return {
        "random": random_dataset,
        "prefix-repetition": prefix_repetition_dataset,
        "multi-turn": multi_turn_dataset,
        "mooncake": mooncake_dataset,
        "azure": azure_dataset,
    }


def build_workload(
    spec: DatasetSpec, tokens: TokenSource, max_model_len: int | None = None
) -> Workload:
    """The dataset ``spec.name``, fitted to the caps and to ``max_model_len`` (prompt plus
    output tokens of a request; None: no limit)."""
    builders = _builders()
    if spec.name not in builders:
        raise ValueError(f"unknown dataset {spec.name!r}; choose from {', '.join(DATASETS)}")
    sessions, changed = [], 0
    for session in builders[spec.name](spec, tokens):
        fitted, was_changed = _fit_turns(session, spec, max_model_len)
        sessions.append(fitted)
        changed += was_changed
    notes = []
    if changed:
        notes.append(
            f"{changed} of {len(sessions)} sessions clipped to the caps or to the context "
            f"window ({max_model_len} tokens)"
        )
    return Workload(spec.name, tuple(sessions), tuple(notes))
