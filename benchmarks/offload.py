"""What the CPU offload tier buys: prefix hit ratio on Mooncake traces and TTFT on a
multi-turn workload, each with and without the tier, side by side in one run.

    python -m benchmarks.offload [--part hits|ttft|both] [--model DIR]

* hits: the traces replayed through the engine's own ``KVCacheManager`` and ``CpuTier``
  (no model; one Mooncake hash id = one block of 16 synthetic tokens, so chained hashes
  reproduce the trace's prefix structure exactly), for a device pool of --device-blocks
  with and without --cpu-blocks of CPU tier, against the ideal (one unbounded cache).
* ttft: conversations whose every turn extends the previous one, served one turn at a
  time by the real engine on a device pool too small to keep them; TTFT per turn with and
  without the tier (same prompts, same outputs asserted).
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

from benchmarks.loadgen.traces import traces_dir
from common.engine_config import EngineConfig
from engine.cpu_tier import CpuTier
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

TRACES = traces_dir() / "mooncake"
RESULTS = Path(__file__).parent / "results"
SIM_BLOCK = 16


def _trace(path: Path) -> list[list[int]]:
    return [json.loads(line)["hash_ids"] for line in path.open()]


def replay_hits(path: Path, device_blocks: int, cpu_blocks: int) -> dict:
    """Hit ratio (in blocks) of a trace through the engine's pool (+ CPU tier)."""
    caches = [torch.zeros(device_blocks, 2, SIM_BLOCK, 1, 1)]  # tiny KV: bookkeeping matters
    tier = None
    if cpu_blocks:
        tier = CpuTier(caches, cpu_blocks * SIM_BLOCK * 2 * 4)
    kv = KVCacheManager(device_blocks, SIM_BLOCK, True, [tier] if tier else [], tier)
    params = SamplingParams(max_tokens=1)
    hits = total = 0
    for n, hash_ids in enumerate(_trace(path)):
        # Block i's tokens: the hash id spread over SIM_BLOCK tokens (same id → same tokens).
        tokens = [h * SIM_BLOCK + j for h in hash_ids for j in range(SIM_BLOCK)]
        tokens.append(0)  # one token past the last block, so every block can hit
        request = Request(f"r{n}", tokens, params, frozenset(), len(tokens) + 1)
        kv.update_block_hashes(request)
        device, num_device_tokens = kv.get_computed_blocks(request)
        loaded = kv.get_secondary_hits(request, len(device))
        request.num_computed_tokens = 0
        assert kv.allocate_slots(request, len(tokens) - num_device_tokens, device)
        if tier is not None:
            tier.reserve(loaded)
            tier.flush()
            block_ids = kv.get_block_ids(request.request_id)
            tier.load(loaded, block_ids[len(device) : len(device) + len(loaded)])
        hits += len(device) + len(loaded)
        total += len(hash_ids)
        kv.free(request)
    if tier is not None:
        tier.flush()
    leaks = kv.leak_report() + (tier.leak_report() if tier else [])
    assert not leaks, leaks
    return {"hit_ratio": hits / total, "cpu_hit_blocks": tier.stats.hit_blocks if tier else 0}


def ideal_hits(path: Path) -> float:
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for hash_ids in _trace(path):
        run = 0
        for i in range(len(hash_ids)):
            if tuple(hash_ids[: i + 1]) not in seen:
                break
            run += 1
        hits += run
        total += len(hash_ids)
        seen.update(tuple(hash_ids[: i + 1]) for i in range(len(hash_ids)))
    return hits / total


def part_hits(args: argparse.Namespace) -> list[dict]:
    rows = []
    for path in sorted(TRACES.glob("*.jsonl")):
        start = time.perf_counter()
        device = replay_hits(path, args.device_blocks, 0)
        tiered = replay_hits(path, args.device_blocks, args.cpu_blocks)
        big = replay_hits(path, args.device_blocks + args.cpu_blocks, 0)
        row = {
            "trace": path.name,
            "ideal": ideal_hits(path),
            f"device_{args.device_blocks}": device["hit_ratio"],
            f"device_{args.device_blocks}+cpu_{args.cpu_blocks}": tiered["hit_ratio"],
            f"device_{args.device_blocks + args.cpu_blocks}": big["hit_ratio"],
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(json.dumps(row))
    return rows


def part_ttft(args: argparse.Namespace) -> dict:
    from engine.llm_engine import LLMEngine
    from engine.models.maker import ensure_model

    model = Path(args.model) if args.model else ensure_model("llama", "small")
    rng = random.Random(0)
    turns = [[[rng.randrange(5, 8000) for _ in range(args.turn_tokens)]
              for _ in range(args.turns)] for _ in range(args.conversations)]  # fmt: skip
    params = SamplingParams(max_tokens=args.output_tokens, min_tokens=args.output_tokens,
                            temperature=0)  # fmt: skip
    result = {}
    outputs = {}
    for label, tier_bytes in (("device_only", 0), ("device+cpu", args.cpu_tier_bytes)):
        config = EngineConfig(
            num_blocks=args.ttft_device_blocks,
            max_model_len=args.ttft_device_blocks * 16,
            cpu_offload_bytes=tier_bytes,
        )
        engine = LLMEngine(model, config)
        history = [[] for _ in turns]
        ttfts, produced = [], []
        for turn in range(args.turns):
            for c, conversation in enumerate(turns):  # conversations interleave
                history[c] = history[c] + conversation[turn]
                request_id = f"{c}-{turn}"
                start = time.perf_counter()
                engine.add_request(request_id, history[c], params)
                first = None
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if first is None and out.new_token_ids:
                            first = time.perf_counter() - start
                        if out.finished:
                            history[c] = history[c] + out.outputs[0].token_ids
                            produced.append(out.outputs[0].token_ids)
                ttfts.append(first)
        assert engine.leak_report() == []
        outputs[label] = produced
        ttfts.sort()
        result[label] = {
            "mean_ttft_s": statistics.mean(ttfts),
            "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
            "prompt_tokens_computed": engine.num_prompt_tokens_computed,
            "cpu_hit_blocks": engine.cpu_tier.stats.hit_blocks if engine.cpu_tier else 0,
        }
        print(label, json.dumps(result[label]))
    assert outputs["device_only"] == outputs["device+cpu"], "the tier changed the outputs"
    result["mean_ttft_ratio"] = (
        result["device_only"]["mean_ttft_s"] / result["device+cpu"]["mean_ttft_s"]
    )
    result["model"] = model.name
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["hits", "ttft", "both"], default="both")
    parser.add_argument("--device-blocks", type=int, default=1000)
    parser.add_argument("--cpu-blocks", type=int, default=32000)
    parser.add_argument("--model", default=None, help="for ttft (default: made 'small' llama)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=160)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--ttft-device-blocks", type=int, default=64)
    parser.add_argument("--cpu-tier-bytes", type=int, default=2 << 30)
    args = parser.parse_args()
    record: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} ({torch.get_num_threads()} threads), torch "
        f"{torch.__version__}",
    }
    if args.part in ("hits", "both"):
        record["hits"] = part_hits(args)
    if args.part in ("ttft", "both"):
        record["ttft"] = part_ttft(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"offload_{args.part}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
