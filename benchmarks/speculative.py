"""What speculative decoding buys: decode throughput with and without verified drafts, on
the same prompts in the same process, the tokens asserted equal.

    python -m benchmarks.speculative [--size tiny|small | --model DIR] [--batch 16] ...

Three parts, each against a baseline engine without drafts:

* replay: drafts replayed from the baseline's own output, each replaced by a wrong token
  with probability ``p_wrong``. It measures the engine's side of speculation (the cost of
  verifying k drafts against the tokens they save) at known acceptance rates, whatever
  proposes the drafts. p_wrong = 1 is the worst case: every step pays for k drafts and
  keeps none.
* ngram: the n-gram proposer on random prompts. Random-weight models do not repeat
  themselves, so it finds (almost) nothing to propose: this is its overhead.
* ngram-looping: the n-gram proposer where outputs repeat (a few allowed tokens make the
  random model loop), the kind of output it is for.

Times are medians of ``--repeats`` runs; on a shared CPU machine only the ratios mean
anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.offline_runs import run_all
from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.models.maker import ensure_model
from engine.request import Request

RESULTS = Path(__file__).parent / "results"


class ReplayProposer:
    """Proposes each request's continuation from ``reference`` (request id -> tokens), every
    draft replaced by another token with probability ``p_wrong``; records whom it was
    asked for. A stand-in for a draft model of known quality."""

    def __init__(
        self, reference: dict[str, list[int]], p_wrong: float, vocab_size: int, seed: int = 0
    ) -> None:
        self.reference = reference
        self.p_wrong = p_wrong
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.asked: set[str] = set()

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        self.asked.add(request.request_id)
        done = request.num_output_tokens
        drafts = list(self.reference.get(request.request_id, [])[done : done + max_drafts])
        for i, token in enumerate(drafts):
            if self.rng.random() < self.p_wrong:
                drafts[i] = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return drafts


def counted_run(engine: LLMEngine, prompts, params) -> tuple[dict, float, dict]:
    """(tokens, seconds, draft counts) of one run of ``prompts`` through ``engine``."""
    scheduler = engine.scheduler

    def counts() -> dict[str, int]:
        return {
            "draft_tokens": scheduler.num_draft_tokens,
            "accepted_tokens": scheduler.num_accepted_tokens,
            "steps": engine.num_steps,
        }

    before = counts()
    start = time.perf_counter()
    tokens = run_all(engine, prompts, params)
    seconds = time.perf_counter() - start
    return tokens, seconds, {key: value - before[key] for key, value in counts().items()}


def timed_run(engine: LLMEngine, prompts, params, repeats: int) -> tuple[dict, float, dict]:
    """(tokens, median seconds, draft counts of one run) after a warm-up run."""
    run_all(engine, prompts, params)
    runs = [counted_run(engine, prompts, params) for _ in range(repeats)]
    tokens, _, counts = runs[-1]
    return tokens, statistics.median(seconds for _, seconds, _ in runs), counts


def alternating_run(
    baseline: LLMEngine, engine: LLMEngine, prompts, params, repeats: int
) -> tuple[tuple[dict, float, dict], float]:
    """``timed_run``'s result for ``engine`` and the baseline's median seconds, the two
    timed alternately (the baseline first each round) after a warm-up of ``engine``, so
    that a shared machine's drift falls on both alike."""
    run_all(engine, prompts, params)
    rounds = [
        (counted_run(baseline, prompts, params), counted_run(engine, prompts, params))
        for _ in range(repeats)
    ]
    tokens, _, counts = rounds[-1][1]
    seconds = statistics.median(run[1] for _, run in rounds)
    return (tokens, seconds, counts), statistics.median(base[1] for base, _ in rounds)


def vs_baseline(
    name: str, baseline_s: float, tokens_expected: dict, run: tuple, extra: dict
) -> dict:
    tokens, seconds, counts = run
    assert tokens == tokens_expected, f"{name}: drafts changed the tokens"
    drafted = counts["draft_tokens"]
    row = {
        "case": name, **extra, **counts,
        "acceptance": counts["accepted_tokens"] / drafted if drafted else None,
        "seconds": seconds,
        "speedup": baseline_s / seconds,
    }  # fmt: skip
    acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
    print(f"{name:<34} acceptance {acceptance:>5}  steps {counts['steps']:>5}  "
          f"{seconds:7.2f} s  speedup {row['speedup']:.2f}x", flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--model", default=None, help="a checkpoint (default: made llama)")
    parser.add_argument("--batch", type=int, default=16, help="max_num_seqs")
    parser.add_argument(
        "--requests",
        type=int,
        default=64,
        help="more than --batch: the "
        "batch stays full, so a run measures throughput, not its slowest request",
    )
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--p-wrong", type=float, nargs="+", default=[0.0, 0.2, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file (default: under results/)")
    args = parser.parse_args()
    model = Path(args.model) if args.model else ensure_model("llama", args.size)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(5, 2000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    overrides = {"max_num_seqs": args.batch}
    baseline = LLMEngine(model, EngineConfig(**overrides))
    vocab_size = baseline.arch.vocab_size
    rows = []
    print(f"{model.name}: {args.requests} requests, batch {args.batch}, "
          f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens")  # fmt: skip

    reference, baseline_s, _ = timed_run(baseline, prompts, params, args.repeats)
    print(f"{'baseline (no drafts)':<34} {baseline_s:7.2f} s", flush=True)
    for k in args.k:
        engine = LLMEngine(model, EngineConfig(**overrides, num_speculative_tokens=k))
        for p_wrong in args.p_wrong:
            engine.scheduler.proposer = ReplayProposer(reference, p_wrong, vocab_size)
            run = timed_run(engine, prompts, params, args.repeats)
            rows.append(vs_baseline(f"replay k={k} p_wrong={p_wrong}", baseline_s, reference, run,
                                 {"part": "replay", "k": k, "p_wrong": p_wrong}))  # fmt: skip

    ngram = LLMEngine(model, EngineConfig(**overrides, num_speculative_tokens=4))
    run = timed_run(ngram, prompts, params, args.repeats)
    rows.append(vs_baseline("ngram k=4 (random prompts)", baseline_s, reference, run,
                         {"part": "ngram", "k": 4}))  # fmt: skip

    looping = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                             allowed_token_ids=list(range(60, 66)))  # fmt: skip
    loop_reference, loop_baseline_s, _ = timed_run(baseline, prompts, looping, args.repeats)
    print(f"{'baseline, looping outputs':<34} {loop_baseline_s:7.2f} s", flush=True)
    run = timed_run(ngram, prompts, looping, args.repeats)
    rows.append(vs_baseline("ngram k=4 (looping outputs)", loop_baseline_s, loop_reference, run,
                         {"part": "ngram-looping", "k": 4}))  # fmt: skip

    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} ({torch.get_num_threads()} threads), torch "
        f"{torch.__version__}, {baseline.device}, {baseline.dtype}, "
        f"attention {baseline.runner.backend.name}",
        "model": f"llama {args.size}" if not args.model else str(model),
        "batch": args.batch,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "baseline_s": baseline_s,
        "rows": rows,
    }
    out = (
        Path(args.out)
        if args.out
        else RESULTS / f"speculative_{baseline.device.type}_{args.size}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
