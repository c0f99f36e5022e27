"""``pdserve generate``: offline generation with the engine (the demo model by default)."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):",
    "In a distant galaxy, a small robot",
    "import numpy as np\n",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: demo)")
    parser.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch or triton")
    parser.add_argument("--lora", default=None, help="a LoRA adapter directory to generate with")
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="split the model over this many devices (processes on CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto",
        help="what the KV cache stores: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from common.config_base import ConfigError
    from engine import LLM, InvalidRequestError, SamplingParams
    from engine.models.arch import ModelLoadError

    prompts = args.prompt or list(DEFAULT_PROMPTS)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        if args.model is None:
            print("using the built-in demo model (made on first use)", file=sys.stderr)
        adapters = {"lora": args.lora} if args.lora else None
        llm = LLM(
            args.model, adapters, device=args.device, attention_backend=args.attention_backend,
            tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
        with llm:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_name="lora" if args.lora else None)
    except (InvalidRequestError, ModelLoadError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for output in outputs:
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"--- prompt: {output.prompt!r}")
        print(f"    output ({len(completion.token_ids)} tokens, {completion.finish_reason}):")
        print(f"    {completion.text!r}")
    print(
        f"{len(outputs)} request{'' if len(outputs) == 1 else 's'}, {num_tokens} tokens in "
        f"{elapsed:.2f}s "
        f"({num_tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


COMMAND = ("generate offline with the engine", add_arguments, run)
