"""What a benchmark sends: sessions of turns, each turn one streamed completion request.

A session is a chain of requests that depend on each other. Its first turn's prompt is the
turn's own tokens; turn k+1's prompt is turn k's prompt, turn k's output and turn k+1's own
tokens (a chat history). Turn k+1 is sent only after turn k finished. Single-request
datasets (random, prefix-repetition, traces) are sessions of one turn.

Prompts are token ids, sent to /v1/completions with ``ignore_eos`` and ``max_tokens``, so
every prompt length and output length is exact and no tokenizer is needed on either side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: ``new_tokens`` are appended to the session's history to form the
    prompt; the server must generate exactly ``output_tokens`` tokens."""

    new_tokens: tuple[int, ...]
    output_tokens: int

    def __post_init__(self) -> None:
        if not self.new_tokens:
            raise ValueError("a turn needs at least one new prompt token")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")


@dataclass(frozen=True, slots=True)
class Session:
    """Turns sent one after another. ``arrival_s`` is the trace's arrival time of the
    first turn (None for synthetic datasets); ``think_time_s`` is the pause between a
    turn's end and the next turn's start."""

    session_id: int
    turns: tuple[Turn, ...]
    arrival_s: float | None = None
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError("a session needs at least one turn")


@dataclass(frozen=True, slots=True)
class Workload:
    """A dataset, ready to send. ``notes`` say what was changed to fit the server (e.g.
    prompts clipped to the context window) and are copied into the report."""

    dataset: str
    sessions: tuple[Session, ...]
    notes: tuple[str, ...] = ()

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    @property
    def has_trace_times(self) -> bool:
        return bool(self.sessions) and all(s.arrival_s is not None for s in self.sessions)
