"""What priority scheduling buys interactive traffic that shares an overloaded engine with
batch traffic, and what the batch traffic pays: the same arrivals served with
``engine.scheduling_policy`` fcfs and priority, side by side in one run.

    python -m benchmarks.priority [--model DIR | --size small] [--num-requests 96]

Requests arrive open-loop (Poisson) at ``--load`` times the rate the engine sustains
(measured first, on a burst of the same requests under FCFS), so a queue builds. A
``--interactive-share`` of them carry priority 0, the rest priority 1; both classes draw
prompts and output lengths from the same ranges, so the priority is the only difference.
Under FCFS everyone carries 0 (the policy refuses anything else) and the classes are only
labels. Measured per policy and class: time to first token and end-to-end latency from
each request's arrival (p50, p90), and for the run: output tokens/s, preemptions. Every
sequence is greedy, and each policy's tokens are checked equal to the other's (priority
preemption recomputes; it must not change a token). Writes
``benchmarks/results/priority_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_throughput import make_prompts
from benchmarks.records import write_record
from benchmarks.side_by_side import add_model_args, model_dir, record_header
from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.models.arch import read_arch_config

CLASSES = ("interactive", "batch", "all")
METRICS = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s")


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float  # after the run's start
    prompt: list[int]
    output_len: int
    interactive: bool

    @property
    def params(self) -> SamplingParams:
        """Greedy, exactly ``output_len`` tokens."""
        return SamplingParams(max_tokens=self.output_len, min_tokens=self.output_len,
                              temperature=0)  # fmt: skip


def make_arrivals(
    num: int, rate_per_s: float, prompts: list[list[int]], output_lens: list[int], share: float
) -> list[Arrival]:
    rng = random.Random(1)
    offset, arrivals = 0.0, []
    for prompt, output_len in zip(prompts[:num], output_lens[:num], strict=True):
        offset += rng.expovariate(rate_per_s)
        arrivals.append(Arrival(offset, prompt, output_len, rng.random() < share))
    return arrivals


def engine_config(args: argparse.Namespace, policy: str) -> EngineConfig:
    return EngineConfig(
        scheduling_policy=policy,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_prompt_len + args.max_output_len + 16,
        # On, as deployed: a preempted request recomputes its prompt from its cached blocks
        # where they survived. The prompts share nothing, so it saves nothing else.
        enable_prefix_caching=True,
    )


def capacity(model: Path, args: argparse.Namespace, arrivals: list[Arrival]) -> float:
    """Requests per second FCFS sustains on a burst of the workload's first requests."""
    engine = LLMEngine(model, engine_config(args, "fcfs"))
    burst = arrivals[: 2 * args.max_num_seqs]
    start = time.perf_counter()
    for i, arrival in enumerate(burst):
        engine.add_request(f"c{i}", arrival.prompt, arrival.params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.leak_report() == [], engine.leak_report()
    return len(burst) / (time.perf_counter() - start)


def serve(model: Path, args: argparse.Namespace, policy: str, arrivals: list[Arrival]) -> dict:
    engine = LLMEngine(model, engine_config(args, policy))
    pending = list(enumerate(arrivals))
    times: dict[str, tuple[float, float | None, float | None]] = {}  # arrival, first, done
    tokens: dict[str, list[int]] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1].offset_s <= now:
            index, arrival = pending.pop(0)
            priority = 0 if arrival.interactive or policy == "fcfs" else 1
            engine.add_request(f"r{index}", arrival.prompt, arrival.params, priority=priority)
            times[f"r{index}"] = (start + arrival.offset_s, None, None)
        if not engine.has_unfinished_requests():
            time.sleep(max(pending[0][1].offset_s - now, 0.0))
            continue
        for output in engine.step():
            arrived, first, _ = times[output.request_id]
            if first is None and output.outputs[0].token_ids:
                first = time.monotonic()
            done = time.monotonic() if output.finished else None
            times[output.request_id] = (arrived, first, done)
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    elapsed = time.monotonic() - start
    assert engine.leak_report() == [], engine.leak_report()
    by_class: dict[str, dict] = {}
    for name in CLASSES:
        ids = [f"r{i}" for i, a in enumerate(arrivals)
               if name == "all" or a.interactive == (name == "interactive")]  # fmt: skip
        ttft = [times[r][1] - times[r][0] for r in ids]
        e2e = [times[r][2] - times[r][0] for r in ids]
        by_class[name] = {
            "num_requests": len(ids),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "e2e_p50_s": percentile(e2e, 50),
            "e2e_p90_s": percentile(e2e, 90),
        }
    return {
        "policy": policy,
        "wall_s": elapsed,
        "output_tokens_per_s": sum(a.output_len for a in arrivals) / elapsed,
        "preemptions": engine.scheduler.num_preemptions,
        "classes": by_class,
        "tokens": [tokens[f"r{i}"] for i in range(len(arrivals))],
    }


def round_ratios(fcfs: dict, prio: dict) -> dict[str, float]:
    """priority / fcfs of every class's latencies, and of output tokens/s, in one round."""
    ratios = {
        f"{name} {metric}": prio["classes"][name][metric] / fcfs["classes"][name][metric]
        for name in CLASSES
        for metric in METRICS
    }
    ratios["output tokens/s"] = prio["output_tokens_per_s"] / fcfs["output_tokens_per_s"]
    return ratios


def median_run(runs: list[dict]) -> dict:
    """One policy's runs over the rounds: each figure the median of its rounds'."""
    return {
        "policy": runs[0]["policy"],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
        "preemptions": statistics.median(r["preemptions"] for r in runs),
        "classes": {
            name: {
                "num_requests": runs[0]["classes"][name]["num_requests"],
                **{m: statistics.median(r["classes"][name][m] for r in runs) for m in METRICS},
            }
            for name in CLASSES
        },
    }


def percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--interactive-share", type=float, default=0.25)
    parser.add_argument("--load", type=float, default=1.3,
                        help="arrival rate / the rate FCFS sustains")  # fmt: skip
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of both policies, alternating; medians reported")  # fmt: skip
    args = parser.parse_args()
    for low, high in (("min_prompt_len", "max_prompt_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, low) <= getattr(args, high):
            parser.error(f"need 1 <= --{low.replace('_', '-')} <= --{high.replace('_', '-')}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    model = model_dir(args)
    arch = read_arch_config(model)
    prompts = make_prompts(args.num_requests, args.min_prompt_len, args.max_prompt_len,
                           arch.vocab_size, seed=0)  # fmt: skip
    rng = random.Random(2)
    output_lens = [rng.randint(args.min_output_len, args.max_output_len) for _ in prompts]
    draft = make_arrivals(args.num_requests, 1.0, prompts, output_lens, args.interactive_share)
    print("measuring what FCFS sustains ...", flush=True)
    rate = args.load * capacity(model, args, draft)
    arrivals = make_arrivals(args.num_requests, rate, prompts, output_lens,
                             args.interactive_share)  # fmt: skip
    rounds: list[tuple[dict, dict]] = []
    for index in range(args.rounds):
        pair = []
        for policy in ("fcfs", "priority"):
            print(f"round {index + 1}/{args.rounds}: scheduling_policy={policy} ...", flush=True)
            pair.append(serve(model, args, policy, arrivals))
        rounds.append((pair[0], pair[1]))
    reference = rounds[0][0]["tokens"]
    identical = min(
        sum(a == b for a, b in zip(reference, run["tokens"], strict=True))
        for pair in rounds
        for run in pair
    )
    per_round = [round_ratios(fcfs, prio) for fcfs, prio in rounds]
    ratios = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    ranges = {key: (min(r[key] for r in per_round), max(r[key] for r in per_round))
              for key in per_round[0]}  # fmt: skip
    runs = [median_run([pair[i] for pair in rounds]) for i in (0, 1)]
    record = {
        **record_header(args),
        "num_requests": args.num_requests,
        "interactive_share": args.interactive_share,
        "load": args.load,
        "arrival_rate_per_s": rate,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "rounds": args.rounds,
        "runs": runs,
        "every_run": [
            [{k: v for k, v in run.items() if k != "tokens"} for run in pair] for pair in rounds
        ],
        "priority_vs_fcfs": ratios,
        "priority_vs_fcfs_range": ranges,
        "identical_sequences": f"{identical}/{len(arrivals)}",
    }
    stem = args.out_dir / f"priority_{args.tag}"
    lines = [
        f"# Priority scheduling under overload: `python -m benchmarks.priority --size {args.size}`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"{record['date']}. {args.num_requests} requests arriving (Poisson) at {rate:.2f}/s, "
        f"{args.load}x what FCFS sustained on a burst; {args.interactive_share:.0%} "
        f"interactive (priority 0), the rest batch (priority 1); prompts "
        f"{args.min_prompt_len}-{args.max_prompt_len} tokens, {args.min_output_len}-"
        f"{args.max_output_len} greedy output tokens, the same ranges for both classes; "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}; prefix caching on (the prompts share nothing: it "
        "serves only preempted requests' recompute). Latencies from each request's arrival. "
        f"{args.rounds} rounds of both policies, alternating: medians over the rounds "
        "(ratios: the median of each round's ratio, and their range).",
        "",
        "| policy | class | requests | TTFT p50 s | TTFT p90 s | e2e p50 s | e2e p90 s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        for name in CLASSES:
            c = run["classes"][name]
            lines.append(
                f"| {run['policy']} | {name} | {c['num_requests']} | {c['ttft_p50_s']:.2f} | "
                f"{c['ttft_p90_s']:.2f} | {c['e2e_p50_s']:.2f} | {c['e2e_p90_s']:.2f} |"
            )
    lines += ["", "| policy | wall s | output tokens/s | preemptions |", "|---|---:|---:|---:|"]
    for run in runs:
        lines.append(f"| {run['policy']} | {run['wall_s']:.1f} | "
                     f"{run['output_tokens_per_s']:.1f} | {run['preemptions']:g} |")  # fmt: skip
    lines += [
        "",
        f"- sequences identical in every run: {record['identical_sequences']}",
    ]
    for name, value in ratios.items():
        low, high = ranges[name]
        lines.insert(-1, f"- {name} (priority / fcfs): **{value:.2f}x** ({low:.2f}-{high:.2f})")
    write_record(stem, record, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
