"""Priority classes of a benchmark: ``--priority-mix 0:1,1:3`` sends a quarter of the
sessions with ``priority: 0`` and the rest with ``priority: 1`` (vLLM's request field;
lower first where the server schedules by priority). Import-light, for the command line.

A session's class is drawn from ``seed`` (the benchmark's) and the session id, so every run
of a sweep gives the same sessions the same class, and all turns of a session share it."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PriorityMix:
    weights: tuple[tuple[int, float], ...]  # (priority, weight), weights > 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("a priority mix needs at least one class")
        priorities = [priority for priority, _ in self.weights]
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"a priority is given twice in {self}")
        if any(not weight > 0 for _, weight in self.weights):
            raise ValueError(f"weights must be > 0 in {self}")
        if any(not -(2**31) <= priority < 2**31 for priority in priorities):
            raise ValueError("priorities are int32 values")

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> PriorityMix:
        """``"0:1,1:3"`` (PRIORITY:WEIGHT, comma-separated; a bare PRIORITY weighs 1)."""
        weights = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            priority, sep, weight = item.partition(":")
            try:
                weights.append((int(priority), float(weight) if sep else 1.0))
            except ValueError:
                raise ValueError(f"bad priority class {item!r}: use PRIORITY:WEIGHT") from None
        return cls(tuple(weights), seed)

    def of(self, session_id: int) -> int:
        """The class of one session."""
        rng = random.Random(f"{self.seed}/{session_id}")
        priorities = [priority for priority, _ in self.weights]
        return rng.choices(priorities, [weight for _, weight in self.weights])[0]

    def __str__(self) -> str:
        return ",".join(f"{priority}:{weight:g}" for priority, weight in self.weights)
