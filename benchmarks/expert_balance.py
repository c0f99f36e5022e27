"""Expert parallelism's balancing: what rebalancing costs a running engine, and what it
buys in balance.

    python -m benchmarks.expert_balance [--size tiny|small] [--interval 8] [--repeats 3]

Two parts:

* cost (measured): the same prompts on two tensor-parallel engines (``--tp`` ranks,
  experts whole, ``--redundant`` copies), one rebalancing every ``--interval`` steps and
  one never, timed alternately in one process; the tokens must be equal (asserted). Also
  the time of each rebalance (rank 0's wall time: counts read, placement chosen, experts
  exchanged) and the expert slots it rewrote. A made model's random router has no hot
  experts, so this measures the price, not the gain.
* balance (simulated): DeepSeek-V3's shape (256 experts, 8 per token) over 8 or 32
  ranks, tokens routed by a fixed popularity (Zipf with exponent ``s``: ``s = 0`` is
  equal popularity) plus the sampling noise of a window of T tokens. Each window is
  placed by the previous window's counts (what the engine does) and scored on its own:
  ``expert_placement.imbalance``, the busiest rank's pairs over the mean rank's (a layer
  lasts as long as its busiest rank). Beside it, the loaded placement, and the placement
  fit to the window itself (the bound). The popularity is an assumption, not a
  measurement: no real router's counts are on this machine.

On a shared CPU machine only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import make_prompts, run_ours
from benchmarks.records import write_record
from benchmarks.side_by_side import RESULTS, record_header
from engine import LLM
from engine.models.maker import ensure_model
from engine.parallel.expert_placement import imbalance, loaded_placement, rebalance


def _timed_rebalances(llm: LLM) -> list[float]:
    """Wrap the runner's rebalance to record each one's seconds (the list returned)."""
    runner = llm.engine.runner
    rebalance_experts = runner._rebalance_experts
    seconds: list[float] = []

    def timed() -> None:
        start = time.perf_counter()
        rebalance_experts()
        seconds.append(time.perf_counter() - start)

    runner._rebalance_experts = timed
    return seconds


def measure_cost(args: argparse.Namespace, model: Path) -> dict:
    prompts = make_prompts(args.num_prompts, 32, 128, 2000, seed=0)
    base = dict(tensor_parallel_size=args.tp, expert_parallel=True, dtype="float32",
                num_redundant_experts=args.redundant, max_num_seqs=args.num_prompts)  # fmt: skip
    with (
        LLM(model, **base) as still,
        LLM(model, **base, expert_rebalance_interval=args.interval) as moving,
    ):
        rebalance_seconds = _timed_rebalances(moving)
        runs: dict[str, list[float]] = {"never": [], "rebalancing": []}
        tokens = {}
        run_ours(still, prompts[:2], 2)  # warm-up
        run_ours(moving, prompts[:2], 2)
        warm_up_rebalances = len(rebalance_seconds)
        for _ in range(args.repeats):
            for name, llm in (("never", still), ("rebalancing", moving)):
                seconds, tokens[name] = run_ours(llm, prompts, args.output_len)
                runs[name].append(seconds)
        # Rebalancing's share of the timed rounds' wall time.
        share = sum(rebalance_seconds[warm_up_rebalances:]) / sum(runs["rebalancing"])
        assert tokens["never"] == tokens["rebalancing"], "rebalancing changed the tokens"
        balance = moving.engine.runner.expert_balance
        experts = moving.engine.runner.shard.moe_layers[0].experts
        slot_bytes = sum(p[0].numel() * p.element_size() for p in experts.parameters())
        num_steps = moving.engine.num_steps
    never, moving_s = statistics.median(runs["never"]), statistics.median(runs["rebalancing"])
    return {
        "model": str(model.name),
        "tp": args.tp,
        "redundant": args.redundant,
        "interval": args.interval,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "never_s": never,
        "rebalancing_s": moving_s,
        "speed_vs_never": never / moving_s,
        "num_steps": num_steps,
        "num_rebalances": balance.num_rebalances,
        "moved_slots": balance.num_moved_slots,
        "rebalance_ms_median": statistics.median(rebalance_seconds) * 1e3,
        "rebalance_share": share,
        "slot_mib": slot_bytes / 2**20,
    }


def simulate(
    num_ranks: int, redundant: int, skew: float, window_tokens: int, windows: int, seeds: int
) -> dict:
    """Mean imbalances over ``windows`` windows of each of ``seeds`` popularities (which
    expert is hot is the seed's draw)."""
    num_experts, top_k = 256, 8
    loaded = loaded_placement(num_experts, redundant, num_ranks)
    scores: dict[str, list[float]] = {"loaded": [], "previous window": [], "this window": []}
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        order = list(range(1, num_experts + 1))
        random.Random(seed).shuffle(order)
        popularity = torch.tensor([1.0 / rank**skew for rank in order])
        placement = loaded
        for index in range(windows):
            pairs = torch.multinomial(  # each token's k distinct experts
                popularity.expand(window_tokens, -1), top_k, generator=generator
            )
            load = torch.bincount(pairs.flatten(), minlength=num_experts).double().tolist()
            fit = rebalance(load, placement, num_ranks)
            scores["loaded"].append(imbalance([load], [loaded], num_ranks))
            if index:  # the first window's previous placement is the loaded one
                scores["previous window"].append(imbalance([load], [placement], num_ranks))
            scores["this window"].append(imbalance([load], [fit], num_ranks))
            placement = fit
    return {
        "ranks": num_ranks,
        "redundant": redundant,
        "skew": skew,
        "window_tokens": window_tokens,
        **{name: statistics.mean(values) for name, values in scores.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--redundant", type=int, default=2)
    parser.add_argument("--interval", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=4, help="popularities drawn")
    parser.add_argument("--window-tokens", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.model = None  # record_header's: a made model
    model = ensure_model("qwen3_moe", args.size)
    print(f"cost: qwen3_moe {args.size}, tp {args.tp}, {args.redundant} redundant, "
          f"rebalancing every {args.interval} steps ...", flush=True)  # fmt: skip
    cost = measure_cost(args, model)
    print(f"  {cost['speed_vs_never']:.3f}x the speed of never rebalancing; "
          f"{cost['num_rebalances']} rebalances of {cost['rebalance_ms_median']:.1f} ms "
          f"(median), {cost['moved_slots']} slots of {cost['slot_mib']:.1f} MiB moved, "
          f"{cost['rebalance_share']:.1%} of the rebalancing run",
          flush=True)  # fmt: skip
    balance = []
    for num_ranks, redundant in ((8, 0), (8, 32), (32, 0), (32, 32)):
        for skew in (0.0, 0.5, 1.0):
            for window_tokens in args.window_tokens:
                row = simulate(num_ranks, redundant, skew, window_tokens, args.windows, args.seeds)
                balance.append(row)
                print(f"  N={num_ranks} R={redundant} s={skew} T={window_tokens}: loaded "
                      f"{row['loaded']:.3f}, by the previous window {row['previous window']:.3f}, "
                      f"by this one {row['this window']:.3f}", flush=True)  # fmt: skip
    record = {**record_header(args), "model": f"qwen3_moe {args.size}", "cost": cost,
              "balance": balance}  # fmt: skip
    lines = [
        "# Expert parallelism's balancing: `python -m benchmarks.expert_balance`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, {record['date']}.",
        "",
        "## Cost (measured)",
        "",
        f"Made `qwen3_moe {args.size}` (8 experts of {cost['slot_mib']:.1f} MiB, float32), "
        f"tensor_parallel_size {args.tp} with experts whole and {args.redundant} redundant "
        f"slots, {args.num_prompts} prompts of 32-128 tokens, {args.output_len} greedy "
        f"tokens each; rebalancing every {args.interval} steps against never, alternately, "
        f"{args.repeats} rounds, medians. Tokens equal (asserted).",
        "",
        "| never (s) | rebalancing (s) | speed vs never | rebalances | slots moved | "
        "ms per rebalance (median) | rebalances' share of the run |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {cost['never_s']:.2f} | {cost['rebalancing_s']:.2f} | "
        f"**{cost['speed_vs_never']:.3f}x** | {cost['num_rebalances']} | "
        f"{cost['moved_slots']} | {cost['rebalance_ms_median']:.1f} | "
        f"{cost['rebalance_share']:.1%} |",
        "",
        "## Balance (simulated routing)",
        "",
        "256 experts, 8 per token (DeepSeek-V3's shape); popularity Zipf with exponent s, "
        "fixed (which expert is hot drawn at random), plus a window of T tokens' sampling "
        f"noise; means over {args.windows} windows of each of {args.seeds} popularities. "
        "Imbalance: the busiest rank's pairs over the mean rank's.",
        "",
        "| ranks | redundant | s | T tokens | loaded | by the previous window | "
        "by this window (bound) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {row['ranks']} | {row['redundant']} | {row['skew']} | {row['window_tokens']} "
            f"| {row['loaded']:.3f} | **{row['previous window']:.3f}** | "
            f"{row['this window']:.3f} |"
            for row in balance
        ),
    ]
    write_record(args.out_dir / f"expert_balance_{args.tag}", record, "\n".join(lines) + "\n")
    print(f"wrote {args.out_dir / f'expert_balance_{args.tag}'}.json and .md")


if __name__ == "__main__":
    main()
