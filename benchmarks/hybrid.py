"""A hybrid model (Qwen3.5's layout: 3 of every 4 layers gated delta rule; or with
``--arch granite_hybrid_dense`` Granite 4.0-H's: 5 of every 6 Mamba-2) against the dense
model of the same size (Qwen3, or Granite 3: the same width, heads, layers and MLP), side
by side in one run: prompt throughput, decode throughput at a short and a long context,
and the bytes a disaggregated pull moves per request (KV blocks, plus the hybrid's state
blocks).

    python -m benchmarks.hybrid [--size small] [--repeats 3] [--arch granite_hybrid_dense]

Cases, each the median of ``--repeats`` rounds (the models alternating within a round,
after a warm-up round):
- prefill: ``--num-prompts`` prompts of ``--prompt-tokens``, ``max_tokens`` 1;
- decode at context C (``--contexts``): ``--batch`` requests of C prompt tokens, each
  generating ``--decode-tokens``; timed from the first step after every request has its
  first token (prompts done) to the end: decode steps only, the tokens they sampled.
  (It was the difference of two runs, one with and one without the decode; at long
  contexts the prefill dwarfed the decode and the difference was noise.)
- a chat's next turn (``--turn-tokens`` of prompt, a 32-token answer, 64 more tokens;
  ``max_tokens`` 1): its time on an engine with the prefix cache that served the first
  turn, over its time on one without (the hybrid starts from the state snapshot its
  decode left at the answer's last full block; the dense model from every cached
  block: the same tokens), a new conversation each round; the tokens must be the
  uncached engine's. The same again on an engine with a small device pool and a CPU
  tier, two long prompts run between the turns to evict the first turn from the device:
  the next turn's KV and (the hybrid's) state snapshot come back from the tier.
- a shared system prompt (``--system-tokens``, then 64 tokens of each conversation's own;
  ``max_tokens`` 1): three new conversations under a new system prompt each round, the
  second and third timed on the engine with the prefix cache against one without. The
  dense model takes the system prompt's blocks from the second on; the hybrid has no
  states after it until the second, branching there, has snapshotted them
  (``KVCacheManager.state_hit``): it starts from them from the third on.
Both engines' greedy tokens are checked against themselves across rounds (deterministic).
The pull sizes are exact arithmetic from the engines' shapes, not timings.
Writes ``benchmarks/results/hybrid_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np

from benchmarks.records import write_record
from benchmarks.side_by_side import add_model_args, record_header
from engine import LLM, SamplingParams

# The hybrid archs (``maker.ARCHS``) and the dense arch of each one's size.
DENSE_OF = {"qwen3_5": "qwen3", "granite_hybrid_dense": "granite"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=1024)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arch", default="qwen3_5", choices=list(DENSE_OF))
    args = parser.parse_args()
    from engine.models.maker import ensure_model

    dense_arch = DENSE_OF[args.arch]
    models = {f"dense ({dense_arch})": ensure_model(dense_arch, args.size),
              f"hybrid ({args.arch})": ensure_model(args.arch, args.size)}  # fmt: skip
    max_len = max(
        args.contexts + [args.prompt_tokens, args.turn_tokens + 96, args.system_tokens + 64]
    )
    max_len += args.decode_tokens
    engines = {name: LLM(path, dtype="float32", max_model_len=max_len,
                         enable_prefix_caching=False) for name, path in models.items()}  # fmt: skip
    cached = {name: LLM(path, dtype="float32", max_model_len=max_len)
              for name, path in models.items()}  # fmt: skip
    tiered = {}  # a device pool of one long request and two snapshots, a large CPU tier
    for name, path in models.items():
        shard = cached[name].engine.runner.shard
        num_blocks = -(-max_len // cached[name].engine.config.block_size)
        num_blocks += 2 * shard.blocks_per_slot + 4
        tiered[name] = LLM(path, dtype="float32", max_model_len=max_len, num_blocks=num_blocks,
                           cpu_offload_bytes=4 * num_blocks * shard.bytes_per_block)  # fmt: skip
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(5, 2000, length).tolist() for _ in range(n)]

    workloads = {"prefill": (prompts(args.num_prompts, args.prompt_tokens), 1)}
    for context in args.contexts:
        workloads[f"decode@{context}"] = (prompts(args.batch, context), args.decode_tokens)
    request_ids = itertools.count()

    def run(llm: LLM, workload: tuple[list[list[int]], int]) -> tuple[list[list[int]], float, int]:
        """(each request's tokens, seconds, tokens decoded in them): the whole run for a
        prefill workload (``max_tokens`` 1; none decoded), else its steps from the first
        after every prompt is done, and the tokens those steps sampled."""
        batch, max_tokens = workload
        engine = llm.engine
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
        ids = [f"r{next(request_ids)}" for _ in batch]
        start = time.perf_counter()
        for request_id, prompt in zip(ids, batch, strict=True):
            engine.add_request(request_id, prompt, params)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        decoding, num_decoded = False, 0
        while engine.has_unfinished_requests():
            if not decoding and max_tokens > 1 and all(tokens.values()):
                start, decoding = time.perf_counter(), True  # prompts done: decodes only
            for output in engine.step():
                tokens[output.request_id] += output.new_token_ids
                num_decoded += len(output.new_token_ids) if decoding else 0
        return [tokens[request_id] for request_id in ids], time.perf_counter() - start, num_decoded

    first = {(m, w): run(llm, load)[0] for m, llm in engines.items()
             for w, load in workloads.items()}  # fmt: skip
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in first}
    for _ in range(args.repeats):
        for model, llm in engines.items():
            for name, load in workloads.items():
                tokens, seconds, num_decoded = run(llm, load)
                assert tokens == first[model, name], f"{model} {name}: tokens changed"
                num_prompt_tokens = args.num_prompts * args.prompt_tokens
                count = num_prompt_tokens if name == "prefill" else num_decoded
                rates[model, name].append(count / seconds)
    turn_ratios: dict[str, list[float]] = {model: [] for model in engines}
    tier_ratios: dict[str, list[float]] = {model: [] for model in engines}
    tier_hits: dict[str, int] = {}  # the next turn's prompt tokens the tier served
    for _ in range(args.repeats):
        for model in engines:
            first_turn = prompts(1, args.turn_tokens)
            answer = run(cached[model], (first_turn, 32))[0][0]
            assert run(tiered[model], (first_turn, 32))[0][0] == answer
            run(tiered[model], (prompts(2, args.turn_tokens + 96), 1))  # evicts the turn
            next_turn = [first_turn[0] + answer + prompts(1, 64)[0]]
            hit, hit_seconds, _ = run(cached[model], (next_turn, 1))
            kv = tiered[model].engine.scheduler.kv
            num_hit_tokens = kv.num_hit_tokens
            num_tier_tokens = kv.num_secondary_hit_tokens
            loaded, loaded_seconds, _ = run(tiered[model], (next_turn, 1))
            assert kv.num_hit_tokens == num_hit_tokens, f"{model}: the turn stayed on the device"
            tier_hits[model] = kv.num_secondary_hit_tokens - num_tier_tokens
            computed, computed_seconds, _ = run(engines[model], (next_turn, 1))
            assert hit == computed, f"{model}: the next turn's token differs from a cache hit"
            assert loaded == computed, f"{model}: the next turn's token differs from a tier hit"
            turn_ratios[model].append(computed_seconds / hit_seconds)
            tier_ratios[model].append(computed_seconds / loaded_seconds)
    system_ratios: dict[tuple[str, int], list[float]] = {
        (model, conversation): [] for model in engines for conversation in (2, 3)
    }
    system_hits: dict[tuple[str, int], int] = {}  # prompt tokens the cache served
    for _ in range(args.repeats):
        for model in engines:
            system = prompts(1, args.system_tokens)[0]
            conversations = [[system + own] for own in prompts(3, 64)]
            run(cached[model], (conversations[0], 1))
            kv = cached[model].engine.scheduler.kv
            for number, conversation in ((2, conversations[1]), (3, conversations[2])):
                num_hit_tokens = kv.num_hit_tokens
                hit, hit_seconds, _ = run(cached[model], (conversation, 1))
                system_hits[model, number] = kv.num_hit_tokens - num_hit_tokens
                computed, computed_seconds, _ = run(engines[model], (conversation, 1))
                assert hit == computed, f"{model}: conversation {number}'s token differs"
                system_ratios[model, number].append(computed_seconds / hit_seconds)
    for llm in [*engines.values(), *cached.values(), *tiered.values()]:
        assert llm.engine.leak_report() == []
    median = {key: statistics.median(values) for key, values in rates.items()}
    rows = []
    for model in engines:
        row = {"model": model, "prefill_tokens_per_s": median[model, "prefill"]}
        for context in args.contexts:
            row[f"decode_tokens_per_s@{context}"] = median[model, f"decode@{context}"]
        rows.append(row)
    for row in rows:
        row["next_turn_speedup"] = statistics.median(turn_ratios[row["model"]])
        row["next_turn_tier_speedup"] = statistics.median(tier_ratios[row["model"]])
        row["next_turn_tier_hit_tokens"] = tier_hits[row["model"]]
        for number in (2, 3):
            ratios_of = system_ratios[row["model"], number]
            row[f"system_prompt_speedup@{number}"] = statistics.median(ratios_of)
            row[f"system_prompt_hit_tokens@{number}"] = system_hits[row["model"], number]
    dense, hybrid = rows
    ratios = {key: hybrid[key] / dense[key] for key in dense
              if key != "model" and "hit_tokens" not in key}  # fmt: skip
    pulls = []
    for context in (128, 1024, 4096, 32768):
        pull = {"prompt_tokens": context}
        for name, llm in engines.items():
            runner = llm.engine.runner
            blocks = -(-context // llm.engine.config.block_size)
            pull[name] = (blocks + runner.shard.blocks_per_slot) * runner.bytes_per_block
        pulls.append(pull)
    print(f"{' ':<18} {'prefill tok/s':>14}" + "".join(f" {'decode@' + str(c):>14}"
                                                      for c in args.contexts))  # fmt: skip
    for row in [*rows, {"model": "hybrid / dense", **ratios}]:
        values = [row["prefill_tokens_per_s"]] + [row[f"decode_tokens_per_s@{c}"]
                                                  for c in args.contexts]  # fmt: skip
        print(f"{row['model']:<18}" + "".join(f" {v:14.2f}" for v in values))
    for row in rows:
        print(f"{row['model']}: a chat's next turn {row['next_turn_speedup']:.2f}x faster "
              f"from the prefix cache, {row['next_turn_tier_speedup']:.2f}x from the CPU "
              "tier")  # fmt: skip
        print(f"{row['model']}: under a shared system prompt, conversation 2 "
              f"{row['system_prompt_speedup@2']:.2f}x, 3 {row['system_prompt_speedup@3']:.2f}x "
              "faster from the prefix cache")  # fmt: skip
    for pull in pulls:
        print(f"pull of a {pull['prompt_tokens']}-token prompt: " + ", ".join(
            f"{name} {pull[name] / 2**20:.2f} MiB" for name in engines))  # fmt: skip
    record = {**record_header(args), "model": f"{dense_arch} / {args.arch} {args.size}",
              "args": vars(args) | {"out_dir": str(args.out_dir)}, "rows": rows,
              "ratios": ratios, "pull_bytes": pulls}  # fmt: skip
    names = list(engines)
    lines = [
        f"# Hybrid against dense: {args.tag}",
        "",
        f"`python -m benchmarks.hybrid {' '.join(sys.argv[1:])}` ({record['model']}), "
        f"{record['date']}.",
        f"Machine: {record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"float32. Same process, the models alternating in {args.repeats} rounds; medians; "
        "only the ratios mean anything on a shared machine.",
        "",
        "| | prefill tokens/s | "
        + " | ".join(f"decode tokens/s at {c}" for c in args.contexts)
        + " |",
        "|---|---|" + "---|" * len(args.contexts),
        *(
            f"| {row['model']} | {row['prefill_tokens_per_s']:.1f} | "
            + " | ".join(f"{row[f'decode_tokens_per_s@{c}']:.1f}" for c in args.contexts)
            + " |"
            for row in rows
        ),
        f"| hybrid / dense | {ratios['prefill_tokens_per_s']:.2f}x | "
        + " | ".join(f"{ratios[f'decode_tokens_per_s@{c}']:.2f}x" for c in args.contexts)
        + " |",
        "",
        f"A chat's next turn ({args.turn_tokens}-token first prompt, a 32-token answer, 64 "
        "more tokens; time to its first token) with the prefix cache that served the first "
        "turn, against without it (medians):",
        "",
        "The second column: on an engine whose device pool holds one long request, two "
        f"{args.turn_tokens + 96}-token prompts run between the turns (the first turn's "
        "blocks, and the hybrid's state snapshots, evicted to the CPU tier):",
        "",
        "| | next turn: uncached time / cached time | ... / time from the CPU tier |",
        "|---|---|---|",
        *(
            f"| {row['model']} | {row['next_turn_speedup']:.2f}x | "
            f"{row['next_turn_tier_speedup']:.2f}x "
            f"({row['next_turn_tier_hit_tokens']} tokens loaded) |"
            for row in rows
        ),
        "",
        f"New conversations under a shared {args.system_tokens}-token system prompt (64 "
        "tokens of their own; time to the first token), with the prefix cache against "
        "without it (medians; the first conversation fills the cache):",
        "",
        "| | conversation 2 | conversation 3 |",
        "|---|---|---|",
        *(
            f"| {row['model']} | {row['system_prompt_speedup@2']:.2f}x "
            f"({row['system_prompt_hit_tokens@2']} tokens cached) | "
            f"{row['system_prompt_speedup@3']:.2f}x "
            f"({row['system_prompt_hit_tokens@3']} tokens cached) |"
            for row in rows
        ),
        "",
        f"Bytes a disaggregated pull moves per request (float32 KV; the hybrid's include its "
        f"states, {engines[names[1]].engine.runner.shard.blocks_per_slot} blocks):",
        "",
        "| prompt tokens | " + " | ".join(names) + " | hybrid / dense |",
        "|---|---|---|---|",
        *(
            f"| {p['prompt_tokens']} | {p[names[0]] / 2**20:.2f} MiB | "
            f"{p[names[1]] / 2**20:.2f} MiB | {p[names[1]] / p[names[0]]:.2f}x |"
            for p in pulls
        ),
    ]
    stem = args.out_dir / f"hybrid_{args.tag}"
    write_record(stem, record, "\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
