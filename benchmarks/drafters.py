"""The run shared by the drafting benchmarks (``draft_model.py``, ``eagle3.py``): each
drafter against one baseline engine without drafts, on the same prompts in the same
process, timed alternately, the tokens asserted equal; then one record."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from benchmarks.offline_runs import run_all
from benchmarks.records import write_record
from benchmarks.side_by_side import RESULTS, record_header
from benchmarks.speculative import alternating_run, vs_baseline
from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams


def drafter_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--batch", type=int, default=8, help="max_num_seqs")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def compare_drafters(
    args: argparse.Namespace,
    target: Path,
    method: str,
    cases: list[tuple[str, Path, int]],  # (label, the drafter's directory, k)
    name: str,  # the record's file name, before the tag
    title: str,  # the record's heading
    column: str,  # what a case's label names ("draft", "head")
) -> None:
    """Time ``target`` with each case's drafter (``speculative_method: method``) against
    it without drafts, and write ``args.out_dir / f"{name}_{args.tag}"`` (.json, .md)."""
    args.model = None  # record_header's: made models
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 2000) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    base = {"max_num_seqs": args.batch, "dtype": "float32"}
    print(f"llama {args.size} (blocks zeroed): {args.requests} requests, batch {args.batch}, "
          f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens", flush=True)  # fmt: skip
    baseline = LLMEngine(target, EngineConfig(**base))
    reference = run_all(baseline, prompts, params)  # (and a warm-up)
    steps = baseline.num_steps
    run_all(baseline, prompts, params)
    rows = [{"case": "no drafts", column: "-", "acceptance": None,
             "steps": baseline.num_steps - steps, "speedup": 1.0}]  # fmt: skip
    for label, drafter, k in cases:
        config = EngineConfig(**base, speculative_method=method, draft_model=str(drafter),
                              num_speculative_tokens=k)  # fmt: skip
        engine = LLMEngine(target, config)
        run, baseline_s = alternating_run(baseline, engine, prompts, params, args.repeats)
        row = vs_baseline(f"{label} k={k}", baseline_s, reference, run, {"k": k})
        rows.append({**row, column: label, "baseline_s": baseline_s})
        del engine
    record = {**record_header(args), "model": f"llama {args.size}, blocks zeroed",
              "batch": args.batch, "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "rows": rows}  # fmt: skip
    lines = [
        f"# {title}: `python -m benchmarks.{name}`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"{record['date']}. Target: made llama {args.size} with every block's output zeroed "
        f"(a bigram table through all its layers), float32. {args.requests} requests of "
        f"{args.prompt_tokens} prompt tokens, {args.max_tokens} greedy output tokens each, "
        f"`max_num_seqs` {args.batch}. Every row produced exactly the baseline's tokens "
        "(asserted); each ran alternately with the baseline, and the speedup is the ratio "
        "of their median times.",
        "",
        f"| {column} | k | drafts kept | steps | speedup vs no drafts |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        kept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        lines.append(f"| {row[column]} | {row.get('k', '-')} | {kept} | {row['steps']} | "
                     f"{row['speedup']:.2f}x |")  # fmt: skip
    write_record(args.out_dir / f"{name}_{args.tag}", record, "\n".join(lines) + "\n")
    print(f"wrote {args.out_dir / f'{name}_{args.tag}'}.json and .md")
