"""Trace replay datasets: Mooncake (JSONL with prefix-block hash ids) and Azure LLM 2023
(CSV of lengths). The traces carry no text; prompts are synthetic token ids.

Mooncake: each ``hash_ids`` entry names a 512-token block whose identity includes its
prefix. Block id h becomes ``block_tokens`` synthetic tokens, the same for every request
that names h, so requests that share leading ids share a token prefix exactly as the trace
says. Prompt lengths scale by ``block_tokens / 512`` (a small model's context is short);
pick ``block_tokens`` as a multiple of the engine's KV block size so that shared trace
blocks are whole cache blocks. Arrival times are the trace's ``timestamp`` (ms).

Azure: ``ContextTokens`` and ``GeneratedTokens`` give the lengths (times
``input_scale`` / ``output_scale``), ``TIMESTAMP`` the arrival; prompts are fresh random
tokens (the trace has no prefix information).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from datetime import datetime
from itertools import islice
from pathlib import Path

from benchmarks.loadgen.spec import DatasetSpec
from benchmarks.loadgen.tokens import TokenSource
from benchmarks.loadgen.workload import Session, Turn

MOONCAKE_BLOCK_TOKENS = 512
REPO_ROOT = Path(__file__).resolve().parents[2]


def traces_dir() -> Path:
    """``$PDSERVE_TRACES``, else the shared traces next to the repository."""
    return Path(os.environ.get("PDSERVE_TRACES", REPO_ROOT.parent / "shared" / "traces"))


def default_trace(dataset: str) -> Path:
    if dataset == "mooncake":
        return traces_dir() / "mooncake" / "conversation_trace.jsonl"
    if dataset == "azure":
        return traces_dir() / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    raise ValueError(f"{dataset!r} is not a trace dataset")


def _trace_path(spec: DatasetSpec) -> Path:
    path = spec.trace or default_trace(spec.name)
    if not path.exists():
        raise FileNotFoundError(f"trace {path} not found (pass --trace or set PDSERVE_TRACES)")
    return path


def scaled_length(value: int, scale: float) -> int:
    """A trace's length times ``scale``, at least one token."""
    return max(1, round(value * scale))


def mooncake_prompt(
    hash_ids: list[int], input_length: int, tokens: TokenSource, block_tokens: int
) -> tuple[int, ...]:
    """The prompt of one Mooncake row: its blocks' tokens, cut to the scaled length
    ``ceil(input_length * block_tokens / 512)``. The trace guarantees
    ``len(hash_ids) == ceil(input_length / 512)``, so the blocks always cover it."""
    length = max(1, math.ceil(input_length * block_tokens / MOONCAKE_BLOCK_TOKENS))
    prompt: list[int] = []
    for block_id in hash_ids:
        if len(prompt) >= length:
            break
        prompt.extend(tokens.block(block_id, block_tokens))
    if len(prompt) < length:
        raise ValueError(
            f"{len(hash_ids)} hash ids cannot cover {input_length} tokens of 512-token blocks"
        )
    return tuple(prompt[:length])


def jsonl_rows(path: Path, offset: int, count: int | None) -> Iterator[dict]:
    """Rows ``offset`` .. ``offset + count`` of a JSON-lines file (None: to its end)."""
    end = None if count is None else offset + count
    with path.open() as f:
        for line in islice((line for line in f if line.strip()), offset, end):
            yield json.loads(line)


def mooncake_dataset(spec: DatasetSpec, tokens: TokenSource) -> list[Session]:
    sessions = []
    first_ms: float | None = None
    for i, row in enumerate(jsonl_rows(_trace_path(spec), spec.trace_offset, spec.num_requests)):
        first_ms = row["timestamp"] if first_ms is None else first_ms
        prompt = mooncake_prompt(row["hash_ids"], row["input_length"], tokens, spec.block_tokens)
        output = scaled_length(row["output_length"], spec.output_scale)
        arrival_s = (row["timestamp"] - first_ms) / 1000
        sessions.append(Session(i, (Turn(prompt, output),), arrival_s=arrival_s))
    return sessions


def parse_azure_time(text: str) -> float:
    """Seconds since the epoch (naive wall clock; only differences are used)."""
    return datetime.fromisoformat(text.strip()).timestamp()


def azure_dataset(spec: DatasetSpec, tokens: TokenSource) -> list[Session]:
    rng = tokens.stream(4)
    sessions = []
    first_s: float | None = None
    with _trace_path(spec).open(newline="") as f:
        rows = islice(csv.DictReader(f), spec.trace_offset, spec.trace_offset + spec.num_requests)
        for i, row in enumerate(rows):
            at = parse_azure_time(row["TIMESTAMP"])
            first_s = at if first_s is None else first_s
            prompt = tokens.draw(rng, scaled_length(int(row["ContextTokens"]), spec.input_scale))
            output = scaled_length(int(row["GeneratedTokens"]), spec.output_scale)
            sessions.append(Session(i, (Turn(prompt, output),), arrival_s=at - first_s))
    return sessions
