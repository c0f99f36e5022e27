"""What serving LoRA adapters costs: throughput of one engine with adapters loaded, requests
on the base model (the baseline) against requests spread over 1, 2 and 4 adapters, and a
half-base mix, in the same process on the same prompts.

    python -m benchmarks.lora [--size tiny|small] [--rank 16] [--batch 16] ...

Adapters are applied unmerged, per row (``engine/models/lora.py``): each adapted projection
costs two thin matmuls per adapter present in a step, plus a gather and a scatter of that
adapter's rows. The ratio against the base model is that cost. Times are medians of
``--repeats`` runs; on a shared CPU machine only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.offline_runs import run_all
from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.models.lora_maker import make_lora_adapter
from engine.models.maker import ensure_model

RESULTS = Path(__file__).parent / "results"
MAX_ADAPTERS = 4


def _timed(engine, prompts, params, names, repeats: int) -> tuple[dict, float]:
    run_all(engine, prompts, params, names)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run_all(engine, prompts, params, names)
        times.append(time.perf_counter() - start)
    return tokens, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="max_num_seqs")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file (default: under results/)")
    args = parser.parse_args()
    model = ensure_model("llama", args.size)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(5, 2000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            f"a{i}": make_lora_adapter(model, Path(tmp) / f"a{i}", rank=args.rank, seed=i)
            for i in range(MAX_ADAPTERS)
        }
        engine = LLMEngine(model, EngineConfig(max_num_seqs=args.batch), lora_adapters=adapters)
    n = args.requests
    cases = {
        "base model (baseline)": [None] * n,
        "1 adapter": ["a0"] * n,
        "2 adapters": [f"a{i % 2}" for i in range(n)],
        "4 adapters": [f"a{i % 4}" for i in range(n)],
        "half base, 2 adapters": [None if i % 2 else f"a{i // 2 % 2}" for i in range(n)],
    }
    print(f"{model.name}: {n} requests, batch {args.batch}, {args.prompt_tokens} prompt + "
          f"{args.max_tokens} output tokens, rank {args.rank} on every projection")  # fmt: skip
    rows, baseline_s, outputs = [], None, {}
    for case, names in cases.items():
        tokens, seconds = _timed(engine, prompts, params, names, args.repeats)
        baseline_s = baseline_s or seconds
        outputs[case] = tokens
        rows.append({"case": case, "seconds": seconds, "vs_base": baseline_s / seconds})
        print(f"{case:<24} {seconds:7.2f} s   {baseline_s / seconds:.2f}x of base", flush=True)
    # The adapters are real: they change what the model says.
    base = outputs["base model (baseline)"]
    assert sum(base[r] != outputs["1 adapter"][r] for r in base) > n // 2
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} ({torch.get_num_threads()} threads), torch "
        f"{torch.__version__}, {engine.device}, {engine.dtype}, "
        f"attention {engine.runner.backend.name}",
        "model": f"llama {args.size}",
        "rank": args.rank,
        "batch": args.batch,
        "requests": n,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"lora_{engine.device.type}_{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
