"""The batched sampler against the per-row one it replaced, side by side in one process.

    python -m benchmarks.sampler [--device cuda] [--batch 32 256] [--vocab 32000]

For each batch size, logits shape and sampling setting, times ``engine.sampler.sample``
(every stage over the whole batch at once) and ``engine.sampling_reference``'s
``sample_reference`` (one row at a time, as the engine sampled before 2026-11-27) on the
same logits, checks that both chose the same tokens, and prints the ratio. ``--before
REV`` also times the engine's sampler as it was at git revision REV (read from this
repository's history) and checks its tokens too. Logits are Zipf-like (an LM's: the
nucleus of top-p 0.95 is tens to hundreds of tokens) or normal (flat: the nucleus is most
of the vocabulary, the worst case for top-p). Records JSON and Markdown under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import revisions
from engine.penalties import TokenCounts
from engine.sampler import SamplingRow, sample
from engine.sampling_ops import RequestRandom
from engine.sampling_params import SamplingParams
from engine.sampling_reference import sample_reference

SETTINGS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "greedy, min_tokens": {"temperature": 0.0, "min_tokens": 64, "stop_token_ids": [3, 4]},
    "temperature 0.8": {"temperature": 0.8},
    "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top_k 50, top_p 0.95": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "top_p, logprobs 5": {"temperature": 0.8, "top_p": 0.95, "logprobs": 5},
    "top_p, penalties": {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1,
                         "frequency_penalty": 0.2},
}  # fmt: skip


def make_logits(batch: int, vocab: int, kind: str, device: torch.device) -> torch.Tensor:
    """[batch, vocab] float32: ``zipf`` (log-probability falling as -1.1 log rank, each row
    in its own random order, plus a little noise) or ``normal`` (N(0, 2))."""
    generator = torch.Generator().manual_seed(0)
    if kind == "normal":
        return (torch.randn(batch, vocab, generator=generator) * 2).to(device)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * ranks.log()
    order = torch.rand(batch, vocab, generator=generator).argsort(-1)
    noise = torch.randn(batch, vocab, generator=generator) * 0.1
    return (base[order] + noise).to(device)


def make_rows(batch: int, vocab: int, fields: dict, device: torch.device) -> list[SamplingRow]:
    params = SamplingParams(max_tokens=128, **fields)
    rows = []
    for i in range(batch):
        output = [(i * 31 + k * 7) % vocab for k in range(32)]  # 32 tokens generated so far
        banned = (
            frozenset(params.stop_token_ids) if len(output) < params.min_tokens else frozenset()
        )
        counts = TokenCounts() if params.has_penalties else None
        random = None if params.greedy else RequestRandom(1000 + i, torch.Generator(device=device))
        rows.append(SamplingRow(params, random, banned, list(range(100)), output, counts))
    return rows


def sampler_at(revision: str) -> types.ModuleType:
    """``engine/sampler.py`` as it was at ``revision`` of this repository, as a module."""
    source = subprocess.run(["git", "show", f"{revision}:engine/sampler.py"], cwd=revisions.ROOT,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    module = types.ModuleType(f"sampler_at_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:engine/sampler.py", "exec"), module.__dict__)
    return module


def rows_for(before: types.ModuleType, rows: list[SamplingRow], device: torch.device) -> list:
    """``rows`` as the sampler of ``sampler_at`` takes them (a generator per request)."""
    return [
        before.SamplingRow(
            row.params,
            None if row.random is None
            else before.RequestRandom(row.random.seed, torch.Generator(device=device)),
            row.banned_token_ids, row.prompt_token_ids, row.output_token_ids,
            TokenCounts() if row.token_counts is not None else None,
        )
        for row in rows
    ]  # fmt: skip


def time_call(call: Callable[[], list], repeats: int, device: torch.device) -> tuple[float, list]:
    """Median seconds of ``repeats`` calls after one warm-up, and the last call's result."""
    result = call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = call()  # ends in a host sync (.tolist()) on every path
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    before = sampler_at(args.before) if args.before else None
    rows_out = []
    for kind in args.logits:
        for batch in args.batch:
            logits = make_logits(batch, args.vocab, kind, device)
            for name, fields in SETTINGS.items():
                rows = make_rows(batch, args.vocab, fields, device)

                def batched(logits=logits, rows=rows) -> list:
                    return sample(logits.clone(), rows)

                def per_row(logits=logits, rows=rows) -> list:
                    return sample_reference(logits.clone(), rows)

                batched_s, got = time_call(batched, args.repeats, device)
                per_row_s, expected = time_call(per_row, args.repeats, device)
                row = {
                    "logits": kind, "batch": batch, "vocab": args.vocab, "setting": name,
                    "per_row_ms": per_row_s * 1e3, "batched_ms": batched_s * 1e3,
                    "speedup": per_row_s / batched_s, "same_tokens": got == expected,
                }  # fmt: skip
                line = (
                    f"{kind:6s} batch {batch:4d} {name:22s} per-row {row['per_row_ms']:8.2f} "
                    f"ms  batched {row['batched_ms']:8.2f} ms  {row['speedup']:5.1f}x"
                )
                if before is not None:
                    old_rows = rows_for(before, rows, device)

                    def old(logits=logits, rows=old_rows) -> list:
                        return before.sample(logits.clone(), rows)

                    before_s, before_tokens = time_call(old, args.repeats, device)
                    row["before_ms"] = before_s * 1e3
                    row["before_speedup"] = row["before_ms"] / row["batched_ms"]
                    row["same_tokens"] = row["same_tokens"] and before_tokens == got
                    line += (
                        f"  {args.before} {row['before_ms']:8.2f} ms  {row['before_speedup']:5.1f}x"
                    )
                rows_out.append(row)
                print(f"{line}  same tokens: {row['same_tokens']}", flush=True)
    return rows_out


def markdown(record: dict) -> str:
    lines = [
        "# Batched sampler against the per-row sampler",
        "",
        f"`python -m benchmarks.sampler {record['argv']}` on {record['machine']} "
        f"({record['device']}, torch {record['torch']}, {record['date']}). Median of "
        f"{record['repeats']} calls after a warm-up; both samplers on the same logits and "
        "rows, one process. `same tokens`: every sampler run chose every token alike.",
        "",
        "| logits | batch | setting | per-row ms | batched ms | speed-up | same tokens |"
        + (f" {record['before']} ms | {record['before']} / batched |" if record["before"] else ""),
        "|---|---:|---|---:|---:|---:|---|" + ("---:|---:|" if record["before"] else ""),
    ]
    for row in record["rows"]:
        line = (
            f"| {row['logits']} | {row['batch']} | {row['setting']} | {row['per_row_ms']:.2f} "
            f"| {row['batched_ms']:.2f} | {row['speedup']:.1f}x | {row['same_tokens']} |"
        )
        if record["before"]:
            line += f" {row['before_ms']:.2f} | {row['before_speedup']:.1f}x |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--logits", nargs="+", default=["zipf", "normal"],
                        choices=("zipf", "normal"))  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--before",
        default=None,
        metavar="REV",
        help="also time engine/sampler.py as it was at this git revision",
    )
    parser.add_argument("--tag", default=None, help="suffix of the record (default: device)")
    parser.add_argument("--out-dir", type=Path, default=revisions.RESULTS)
    args = parser.parse_args(argv)
    rows = run(args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    args.tag = args.tag or args.device.split(":")[0]
    fields = {"device": device, "repeats": args.repeats, "rows": rows}
    revisions.write_record(args, "sampler", argv, fields, markdown)
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
