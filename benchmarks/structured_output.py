"""What a structured-output constraint costs the engine, against free text, side by side.

    python benchmarks/structured_output.py [--model DIR] [--num-prompts 16] [--output-len 64]

The same prompts, greedy, every request producing exactly ``output_len`` tokens (EOS banned
by ``min_tokens``; the constraints below never complete, so they never stop a request
early): free text, a regex (``[a-z ]*``, llguidance's lexer alone) and a recursive Lark
grammar (its Earley parser too). Variants run in turn for ``--rounds`` rounds; the record
gives each one's median output tokens/s, its ratio to free text, and the time the engine
spent per token computing masks and advancing matchers (``Grammars.allowed`` / ``accept``,
timed by wrapping them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

# Run as a script, this folder is first on sys.path and its kernels.py would shadow the
# kernels package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks.engine_throughput import machine, make_prompts  # noqa: E402
from benchmarks.records import write_markdown  # noqa: E402
from engine import LLM, SamplingParams, StructuredOutput  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VARIANTS = {
    "free text": None,
    "regex": StructuredOutput("regex", "[a-z ]*"),
    "lark grammar": StructuredOutput(
        "grammar", 'start: item*\nitem: WORD "," | "(" item+ ")"\nWORD: /[a-z]+/'
    ),
}


class GrammarClock:
    """Wraps an engine's ``Grammars`` methods to add up the time spent in them."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        grammars = llm.engine.grammars
        for name in ("allowed", "accept"):
            setattr(grammars, name, self._timed(getattr(grammars, name)))

    def _timed(self, method):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run(llm: LLM, clock: GrammarClock, prompts, output_len: int, structured) -> dict:
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0,
                            structured_output=structured)  # fmt: skip
    clock.seconds = 0.0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == len(prompts) * output_len, num_tokens
    assert llm.engine.leak_report() == []
    return {
        "tokens_per_s": num_tokens / elapsed,
        "grammar_us_per_token": clock.seconds / num_tokens * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="structured_output_cpu")
    args = parser.parse_args()

    llm = LLM(args.model) if args.model else LLM()
    clock = GrammarClock(llm)
    vocab = llm.engine.arch.vocab_size
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, seed=0)
    run(llm, clock, prompts[:2], 4, VARIANTS["lark grammar"])  # warm-up: tokenizer, grammars
    samples: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):
        for name, structured in VARIANTS.items():
            result = run(llm, clock, prompts, args.output_len, structured)
            samples[name].append(result)
            rate, grammar_us = result["tokens_per_s"], result["grammar_us_per_token"]
            print(f"round {round_index + 1}: {name:13s} {rate:8.1f} tok/s, "
                  f"grammar {grammar_us:6.1f} us/token", flush=True)  # fmt: skip
    free = statistics.median(s["tokens_per_s"] for s in samples["free text"])
    rows = []
    for name, results in samples.items():
        rate = statistics.median(r["tokens_per_s"] for r in results)
        rows.append({
            "variant": name,
            "tokens_per_s": rate,
            "ratio_to_free_text": rate / free,
            "ratio_range": [min(r["tokens_per_s"] for r in results) / free,
                            max(r["tokens_per_s"] for r in results) / free],
            "grammar_us_per_token": statistics.median(r["grammar_us_per_token"] for r in results),
        })  # fmt: skip
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": str(llm.engine.model_dir),
        "vocab_size": vocab,
        "args": vars(args),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Structured outputs: engine throughput against free text",
        "",
        f"`python benchmarks/structured_output.py --num-prompts {args.num_prompts} "
        f"--output-len {args.output_len} --rounds {args.rounds}`",
        "",
        f"Machine: {record['machine']}. Model: the demo model's shape unless `--model` "
        f"(vocabulary {vocab}). {args.num_prompts} prompts of {args.min_len}-{args.max_len} "
        f"tokens, greedy, {args.output_len} output tokens each, median of {args.rounds} "
        "rounds (range in brackets).",
        "",
        "| variant | output tok/s | ratio to free text | grammar us / token |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        low, high = row["ratio_range"]
        lines.append(f"| {row['variant']} | {row['tokens_per_s']:.1f} | "
                     f"{row['ratio_to_free_text']:.2f} ({low:.2f}-{high:.2f}) | "
                     f"{row['grammar_us_per_token']:.1f} |")  # fmt: skip
    write_markdown(RESULTS / f"{args.name}.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
