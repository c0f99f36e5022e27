"""What an FP8 KV cache buys under a fixed KV memory budget: the same model, prompts and
bytes with ``engine.kv_cache_dtype`` auto and fp8, side by side in one run.

    python -m benchmarks.kv_cache_dtype [--model DIR | --size small] [--num-prompts 32]

A burst of ``--num-prompts`` requests (prompt ``--prompt-len``, ``--output-len`` greedy
tokens, EOS banned) meets a pool of ``--kv-cache-bytes``, sized so that the model dtype
holds only a few of them at once. Measured per dtype: the blocks the bytes hold, the most
sequences running in one step, preemptions (each one recomputes a sequence), the decode
steps' mean batch and tokens/s (forward passes with no prompt token: where a larger batch
pays), wall time and output tokens/s, and the KV bytes per token a prefill worker hands
to a decode worker. Also how far the greedy tokens follow the unrounded cache's (rounding
K/V may change a token at a near-tie; random weights have many). Writes
``benchmarks/results/kv_cache_dtype_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import make_prompts
from benchmarks.records import write_record
from benchmarks.side_by_side import add_model_args, model_dir, record_header
from common.engine_config import EngineConfig
from common.kv_budget import ModelShape
from engine import LLMEngine, SamplingParams
from engine.models.arch import read_arch_config


def measure(
    model: Path, kv_cache_dtype: str, prompts: list[list[int]], output_len: int, kv_bytes: int
) -> dict:
    config = EngineConfig(
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_bytes=kv_bytes,
        max_num_seqs=len(prompts),
        max_model_len=max(len(p) for p in prompts) + output_len,
        enable_prefix_caching=False,  # every run computes every prompt token
    )
    engine = LLMEngine(model, config)
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    most_running, tokens = 0, {}
    decode_steps = decode_tokens = 0
    decode_s = 0.0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        most_running = max(most_running, len(engine.scheduler.running))
        step = engine.last_step
        if step is not None and step.num_prompt_tokens == 0:
            decode_steps, decode_tokens = decode_steps + 1, decode_tokens + step.num_tokens
            decode_s += step.duration_s
        engine.last_step = None
    elapsed = time.perf_counter() - start
    assert engine.leak_report() == [], engine.leak_report()
    runner = engine.runner
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "num_blocks": runner.num_blocks,
        "kv_bytes_per_token": runner.shard.bytes_per_block // config.block_size,
        "most_running": most_running,
        "preemptions": engine.scheduler.num_preemptions,
        "decode_batch": decode_tokens / max(decode_steps, 1),
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "wall_s": elapsed,
        "output_tokens_per_s": len(prompts) * output_len / elapsed,
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--fits", type=int, default=6,
                        help="sequences the model dtype's pool holds whole")  # fmt: skip
    args = parser.parse_args()
    model = model_dir(args)
    arch = read_arch_config(model)
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.prompt_len,
                           arch.vocab_size, seed=0)  # fmt: skip
    # Size the pool in the model dtype's bytes (float32 on a CPU, else 16-bit).
    element_bytes = 4 if not torch.cuda.is_available() else 2
    shape = ModelShape.read(model)
    assert shape is not None
    per_token = shape.bytes_per_block(1, element_bytes)  # what the engine's pool sizing uses
    kv_bytes = args.fits * (args.prompt_len + args.output_len + 16) * per_token
    runs = []
    for kv_cache_dtype in ("auto", "fp8"):
        print(f"kv_cache_dtype={kv_cache_dtype} ...", flush=True)
        runs.append(measure(model, kv_cache_dtype, prompts, args.output_len, kv_bytes))
    base, fp8 = runs
    pairs = list(zip(base["tokens"], fp8["tokens"], strict=True))
    same = sum(a == b for a, b in pairs)
    agree = [  # greedy tokens equal before the first difference, per sequence
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in pairs
    ]
    ratios = {
        "blocks": fp8["num_blocks"] / base["num_blocks"],
        "most_running": fp8["most_running"] / base["most_running"],
        "decode_tokens_per_s": fp8["decode_tokens_per_s"] / base["decode_tokens_per_s"],
        "output_tokens_per_s": fp8["output_tokens_per_s"] / base["output_tokens_per_s"],
        "kv_bytes_per_token": fp8["kv_bytes_per_token"] / base["kv_bytes_per_token"],
    }
    record = {
        **record_header(args),
        "num_prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "kv_cache_bytes": kv_bytes,
        "runs": [{k: v for k, v in run.items() if k != "tokens"} for run in runs],
        "fp8_vs_auto": ratios,
        "identical_sequences": f"{same}/{len(prompts)}",
        "mean_tokens_before_first_difference": sum(agree) / len(agree),
    }
    stem = args.out_dir / f"kv_cache_dtype_{args.tag}"
    lines = [
        f"# FP8 KV cache under a fixed budget: `python -m benchmarks.kv_cache_dtype --size "
        f"{args.size}`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"{record['date']}. {len(prompts)} requests at once, {args.prompt_len}-token prompts, "
        f"{args.output_len} greedy output tokens each; {kv_bytes / 2**20:.1f} MiB of KV "
        f"(the model dtype holds {args.fits} whole sequences); no prefix caching.",
        "",
        "| kv_cache_dtype | blocks | KV bytes/token | most running | preemptions | "
        "decode batch | decode tokens/s | wall s | output tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        lines.append(
            f"| {run['kv_cache_dtype']} | {run['num_blocks']} | {run['kv_bytes_per_token']} | "
            f"{run['most_running']} | {run['preemptions']} | {run['decode_batch']:.1f} | "
            f"{run['decode_tokens_per_s']:.1f} | {run['wall_s']:.1f} | "
            f"{run['output_tokens_per_s']:.1f} |"
        )
    lines += ["", *(f"- {name} (fp8 / auto): **{value:.2f}x**"
                    for name, value in ratios.items())]  # fmt: skip
    lines.append(
        f"- sequences identical to the unrounded cache's: {record['identical_sequences']}; "
        f"greedy tokens equal before the first difference: "
        f"{record['mean_tokens_before_first_difference']:.1f} of {args.output_len} on average"
    )
    write_record(stem, record, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
