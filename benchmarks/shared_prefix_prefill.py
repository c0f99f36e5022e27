"""A burst of prompts sharing a long prefix, prefilled in chunks: this code against an
earlier revision, side by side in one script.

    python -m benchmarks.shared_prefix_prefill [--requests 4 8] [--before REV]

``requests`` prompts of ``--shared`` common tokens and ``--suffix`` tokens of their own
arrive together at one engine (``LLM.generate``) with ``prefill_chunk_tokens`` set, as on
a worker that caps a prompt's share of a step (``deploy/configs/1p2d-long-output.yaml``).
A request looks the prefix cache up when it is admitted; before running requests also
took blocks computed since (``KVCacheManager.get_next_cached_blocks``), a burst went in
lockstep and each request computed most of the shared part. Each case reports the prompt
tokens the engine computed, the wall time and the time to first token (median, max).

``--before REV`` runs the same cases on a ``git worktree`` of REV
(``benchmarks/revisions.py``) and prints the ratios. Records JSON and Markdown under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this folder is first on sys.path and its kernels.py would shadow the
# kernels package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks import revisions  # noqa: E402


def run_case(args: argparse.Namespace, num_requests: int) -> dict:
    from engine import LLM, SamplingParams
    from engine.models.maker import ensure_model

    rng = random.Random(0)
    shared = [rng.randrange(5, 1500) for _ in range(args.shared)]
    prompts = [shared + [rng.randrange(5, 1500) for _ in range(args.suffix)]
               for _ in range(num_requests)]  # fmt: skip
    llm = LLM(
        ensure_model("llama", args.size),
        prefill_chunk_tokens=args.chunk,
        max_num_batched_tokens=args.budget,
        max_model_len=args.shared + args.suffix + args.output + 16,
    )
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    engine = llm.engine
    assert engine.scheduler.kv.pool.reset_prefix_cache()
    computed_before = engine.num_prompt_tokens_computed
    params = SamplingParams(max_tokens=args.output, min_tokens=args.output, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    ttft_s = [o.times.first_token - o.times.arrival for o in outputs]
    leaks = engine.leak_report()
    if leaks:
        raise AssertionError(f"leaked: {leaks}")
    return {
        "requests": num_requests, "shared": args.shared, "suffix": args.suffix,
        "chunk": args.chunk, "budget": args.budget,
        "prompt_tokens_computed": engine.num_prompt_tokens_computed - computed_before,
        "wall_s": wall_s, "ttft_p50_s": statistics.median(ttft_s), "ttft_max_s": max(ttft_s),
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }  # fmt: skip


def run_cases(args: argparse.Namespace) -> list[dict]:
    rows = []
    for num_requests in args.requests:
        row = run_case(args, num_requests)
        rows.append(row)
        print(f"  {num_requests:3d} requests: {row['prompt_tokens_computed']:6d} prompt tokens "
              f"computed, {row['wall_s']:6.2f} s, TTFT p50 {row['ttft_p50_s']:.2f} s "
              f"max {row['ttft_max_s']:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def markdown(record: dict) -> str:
    before = record["before"]
    lines = [
        "# A burst of prompts sharing a prefix, prefilled in chunks",
        "",
        f"{revisions.command_line(record, 'shared_prefix_prefill')}, made llama "
        f"`{record['size']}`. Each request: {record['shared']} shared prompt tokens and "
        f"{record['suffix']} of its own, {record['output']} output tokens, greedy; "
        f"`prefill_chunk_tokens` {record['chunk']}, `max_num_batched_tokens` "
        f"{record['budget']}; the prefix cache empty at the start.",
        "",
    ]
    head = "| requests | prompt tokens computed | wall s | TTFT p50 s | TTFT max s |"
    rule = "|---:|---:|---:|---:|---:|"
    if before:
        head += (f" {before}: computed | wall s | TTFT p50 s | TTFT max s "
                 "| wall ratio | same tokens |")  # fmt: skip
        rule += "---:|---:|---:|---:|---:|---|"
    lines += [head, rule]
    for row in record["rows"]:
        line = (f"| {row['requests']} | {row['prompt_tokens_computed']} | {row['wall_s']:.2f} "
                f"| {row['ttft_p50_s']:.2f} | {row['ttft_max_s']:.2f} |")  # fmt: skip
        if before:
            old = row["before"]
            ratio = old["wall_s"] / row["wall_s"]
            line += (f" {old['prompt_tokens_computed']} | {old['wall_s']:.2f} "
                     f"| {old['ttft_p50_s']:.2f} | {old['ttft_max_s']:.2f} "
                     f"| {ratio:.1f}x | {row['same_tokens']} |")  # fmt: skip
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--shared", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="prefill_chunk_tokens")
    parser.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    revisions.add_args(parser)
    args = parser.parse_args(argv)
    ran = revisions.side_by_side(args, argv, Path(__file__), run_cases)
    if ran is None:  # the --before child
        return 0
    rows, before_rows = ran
    same = True
    for row, old in zip(rows, before_rows or [], strict=before_rows is not None):
        row["same_tokens"] = row["tokens"] == old.pop("tokens")
        row["before"] = old
        same = same and row["same_tokens"]
        print(f"  {row['requests']:3d} requests: {old['wall_s'] / row['wall_s']:.1f}x "
              f"faster, prompt tokens {old['prompt_tokens_computed']} -> "
              f"{row['prompt_tokens_computed']}, same tokens: {row['same_tokens']}",
              file=sys.stderr)  # fmt: skip
    for row in rows:
        del row["tokens"]
    fields = {name: getattr(args, name)
              for name in ("size", "shared", "suffix", "output", "chunk", "budget")}  # fmt: skip
    revisions.write_record(args, "shared_prefix_prefill", argv, {**fields, "rows": rows},
                           markdown)  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
