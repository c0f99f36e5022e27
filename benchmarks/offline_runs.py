"""Run a batch of requests through an engine to the end: what the in-process benchmarks
time (the engine alone, no services)."""

from __future__ import annotations

from collections.abc import Sequence

from engine import LLMEngine, SamplingParams


def run_all(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    lora_names: Sequence[str | None] | None = None,
) -> dict[str, list[int]]:
    """Request ``r{i}`` per prompt (with adapter ``lora_names[i]``, if given), stepped until
    all finish; their tokens by request id. Asserts the engine holds nothing afterwards."""
    names = lora_names if lora_names is not None else [None] * len(prompts)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", prompt, params, lora_name=name)
    tokens = {}
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    assert engine.leak_report() == [], engine.leak_report()
    return tokens
