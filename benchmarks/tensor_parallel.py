"""Tensor parallelism's cost and gain: the same model and prompts at tensor_parallel_size 1
and N, side by side in one run.

    python -m benchmarks.tensor_parallel [--model DIR | --size small] [--tp 2] [--num-prompts 16]

Measured per size: a batch's prefill (one output token), the whole batch (prefill and
``--output-len`` tokens each, greedy, EOS banned; decode time per step is the difference),
and batch-1 decode latency per token. Each rank gets its share of the cores
(``torch.set_num_threads``), so on a CPU the ranks split the same cores one process would
use: what shows is what splitting costs (one all-reduce per attention and MLP block per
step, the batch sent to every rank) against what it gains (smaller matmuls per rank run
in parallel). On GPUs, where each rank has its own device and memory bandwidth, the gain
is the point: a step reads 1/N of the weights per GPU. The tokens of both runs must be
identical (printed). Writes ``benchmarks/results/tensor_parallel_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from benchmarks.engine_throughput import (
    make_prompts,
    per_token_latency,
    positive_difference,
    run_ours,
)
from benchmarks.records import write_record
from benchmarks.side_by_side import add_model_args, model_dir, record_header
from engine import LLM
from engine.models.arch import read_arch_config


def measure(
    model: Path, tp_size: int, prompts: list[list[int]], output_len: int, latency_len: int
) -> dict:
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)  # the worker's; a TP engine shares them over its ranks
    # No prefix caching: every run computes every prompt token.
    with LLM(model, tensor_parallel_size=tp_size, max_num_seqs=len(prompts),
             enable_prefix_caching=False) as llm:  # fmt: skip
        run_ours(llm, prompts[:2], 2)  # warm-up
        runs: dict[str, tuple[float, list[list[int]]]] = {}

        def whole() -> float:
            runs["total"] = min(run_ours(llm, prompts, output_len) for _ in range(2))
            return runs["total"][0]

        def prefill() -> float:
            runs["prefill"] = min(run_ours(llm, prompts, 1) for _ in range(2))
            return runs["prefill"][0]

        # The decode steps are the difference of two timings, each the best of two.
        decode_s = positive_difference(whole, prefill)
        (total_s, tokens), (prefill_s, _) = runs["total"], runs["prefill"]
        latency_s = per_token_latency(lambda p, n: run_ours(llm, p, n), prompts[0], latency_len)
    torch.set_num_threads(cores)
    num_prompt_tokens = sum(len(p) for p in prompts)
    decode_step_s = decode_s / (output_len - 1)
    return {
        "tensor_parallel_size": tp_size,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": num_prompt_tokens / prefill_s,
        "batch_s": total_s,
        "decode_step_ms": decode_step_s * 1e3,
        "output_tokens_per_s": len(prompts) * output_len / total_s,
        "batch1_ms_per_token": latency_s * 1e3,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--latency-output-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    args = parser.parse_args()
    model = model_dir(args)
    vocab = read_arch_config(model).vocab_size
    prompts = make_prompts(args.num_prompts, args.max_prompt_len // 4, args.max_prompt_len,
                           vocab, seed=0)  # fmt: skip
    runs = []
    for tp_size in (1, args.tp):
        print(f"tensor_parallel_size={tp_size} ...", flush=True)
        runs.append(measure(model, tp_size, prompts, args.output_len, args.latency_output_len))
    single, split = runs
    ratios = {
        "prefill_throughput": split["prefill_tokens_per_s"] / single["prefill_tokens_per_s"],
        "decode_step_speed": single["decode_step_ms"] / split["decode_step_ms"],
        "batch1_latency_speed": single["batch1_ms_per_token"] / split["batch1_ms_per_token"],
    }
    same = sum(a == b for a, b in zip(single["tokens"], split["tokens"], strict=True))
    record = {
        **record_header(args),
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "runs": [{k: v for k, v in run.items() if k != "tokens"} for run in runs],
        f"tp{args.tp}_vs_tp1": ratios,
        "identical_sequences": f"{same}/{len(prompts)}",
    }
    stem = args.out_dir / f"tensor_parallel_{args.tag}"
    lines = [
        f"# Tensor parallelism: `python -m benchmarks.tensor_parallel --size {args.size} "
        f"--tp {args.tp}`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"{record['date']}. {len(prompts)} prompts of {args.max_prompt_len // 4}-"
        f"{args.max_prompt_len} tokens, {args.output_len} "
        "greedy output tokens each; each rank gets cores / N threads.",
        "",
        "| tensor_parallel_size | prefill tokens/s | decode step ms (batch) | "
        "output tokens/s | batch-1 ms/token |",
        "|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run['tensor_parallel_size']} | {run['prefill_tokens_per_s']:.0f} | "
            f"{run['decode_step_ms']:.1f} | {run['output_tokens_per_s']:.1f} | "
            f"{run['batch1_ms_per_token']:.2f} |"
        )
    lines += ["", *(f"- {name} (tp{args.tp} / tp1): **{value:.2f}x**"
                    for name, value in ratios.items())]  # fmt: skip
    lines.append(f"- identical sequences: {record['identical_sequences']}")
    write_record(stem, record, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
