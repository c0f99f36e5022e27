"""Mixture-of-experts cost: a Qwen3-MoE model against its dense twin, and against transformers.

    python -m benchmarks.moe [--size small] [--num-prompts 16] [--output-len 64]

The made ``qwen3_moe`` and ``qwen3`` models of one size have the same attention, layers and
width; each MoE layer has 8 experts half the dense MLP's width and runs 2 per token, so a
token's MLP work is the dense model's plus a router matmul (hidden x 8). On a machine
where both are compute-bound, MoE / dense throughput is then the cost of routing and of
grouping tokens by expert (1.0 would be free). The engine runs both on the same prompts
(greedy, EOS banned); transformers' batched ``generate`` runs the MoE model on them too,
as the baseline (its experts loop over the same groups, on left-padded prompts). Batch-1
per-token latency is measured for the three.

Then one layer's MLP alone, dense against sparse, at several token counts (random
weights of the two models' shapes; on CUDA the sparse one runs the fused kernel): where
a step's tokens touch most experts but are too few to be compute-bound, the sparse layer
reads up to 4x the dense layer's weight bytes (8 experts of half width), and memory
bandwidth sets the ratio, not routing. Prints ratios; writes
``benchmarks/results/moe_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.engine_throughput import (
    machine,
    make_prompts,
    per_token_latency,
    run_hf,
    run_ours,
    sync,
)
from benchmarks.records import write_markdown
from engine import LLM
from engine.models.arch import ModelArchConfig

RESULTS = Path(__file__).parent / "results"
LAYER_TOKENS = (1, 4, 16, 64, 512, 4096)


def _ms(module: torch.nn.Module, x: torch.Tensor, repeats: int = 10) -> float:
    module(x)  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        module(x)
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


@torch.inference_mode()
def layer_sweep(
    arch: ModelArchConfig, dense_width: int, device: torch.device, dtype: torch.dtype
) -> list[dict]:
    """One dense MLP against one sparse MLP, per token count: time and weight bytes read.
    On CUDA the sparse layer runs the fused kernel (as the engine's triton backend does)."""
    from engine.models.llama import MLP
    from engine.models.moe import SparseMoe

    assert arch.moe is not None
    torch.manual_seed(0)
    dense = MLP(arch, 0, dense_width).to(device, dtype)
    sparse = SparseMoe(arch, None, fused=device.type == "cuda").to(device, dtype)
    for param in [*dense.parameters(), *sparse.parameters()]:
        torch.nn.init.normal_(param, std=arch.hidden_size**-0.5)
    element_bytes = torch.finfo(dtype).bits // 8
    expert_bytes = 3 * arch.hidden_size * arch.moe.expert_intermediate_size * element_bytes
    rows = []
    for num_tokens in LAYER_TOKENS:
        x = torch.randn(num_tokens, arch.hidden_size, device=device, dtype=dtype)
        dense_ms, sparse_ms = _ms(dense, x), _ms(sparse, x)
        experts_hit = int(sparse.route(x)[0].unique().numel())
        rows.append({
            "tokens": num_tokens, "dense_ms": dense_ms, "moe_ms": sparse_ms,
            "ratio": dense_ms / sparse_ms, "experts_hit": experts_hit,
            "weight_mb_read": {"dense": 3 * arch.hidden_size * dense_width * element_bytes / 1e6,
                               "moe": experts_hit * expert_bytes / 1e6},
        })  # fmt: skip
        print(f"layer, {num_tokens:5d} tokens: dense {dense_ms:7.2f} ms, MoE {sparse_ms:7.2f} ms "
              f"({experts_hit} experts), ratio {dense_ms / sparse_ms:.2f}x")  # fmt: skip
    return rows


def _engine_run(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    # No prefix cache: the warm-up's and the latency probe's prompts are timed ones.
    llm = LLM(model_dir, max_num_seqs=max(len(prompts), 1), dtype=args.dtype,
              enable_prefix_caching=False)  # fmt: skip
    run_ours(llm, prompts[:2], 4)  # warm-up
    seconds, tokens = run_ours(llm, prompts, args.output_len)
    latency = per_token_latency(
        lambda p, n: run_ours(llm, p, n), prompts[0], args.latency_output_len
    )
    assert llm.engine.leak_report() == []
    return {"seconds": seconds, "tokens": tokens, "ms_per_token": latency * 1e3,
            "dtype": llm.engine.dtype, "device": llm.engine.device,
            "cached_tokens": llm.engine.scheduler.kv.num_hit_tokens}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--latency-output-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default=None, help="suffix of the results files")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where records go")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from engine.models.arch import read_arch_config
    from engine.models.maker import ensure_model

    dense_dir, moe_dir = ensure_model("qwen3", args.size), ensure_model("qwen3_moe", args.size)
    arch = read_arch_config(moe_dir)
    assert arch.moe is not None
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, arch.vocab_size, args.seed)
    num_output_tokens = args.num_prompts * args.output_len
    print(f"{args.size} qwen3_moe ({arch.moe.num_experts} experts, {arch.moe.top_k} per token)"
          f" vs qwen3 on {machine()}; {args.num_prompts} prompts of {args.min_len}-"
          f"{args.max_len} tokens, {args.output_len} output tokens each")  # fmt: skip

    dense = _engine_run(dense_dir, prompts, args)
    print(f"pdserve dense: {dense['seconds']:7.2f} s, {dense['ms_per_token']:.2f} ms/token b1")
    moe = _engine_run(moe_dir, prompts, args)
    print(f"pdserve MoE:   {moe['seconds']:7.2f} s, {moe['ms_per_token']:.2f} ms/token b1")

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=moe["dtype"])
    hf = hf.to(moe["device"]).eval()
    pad_id = hf.generation_config.pad_token_id or 0
    run_hf(hf, prompts[:2], 4, pad_id)  # warm-up
    hf_s, hf_tokens = run_hf(hf, prompts, args.output_len, pad_id)
    hf_lat = per_token_latency(
        lambda p, n: run_hf(hf, p, n, pad_id), prompts[0], args.latency_output_len
    )
    print(f"transformers MoE: {hf_s:7.2f} s, {hf_lat * 1e3:.2f} ms/token b1")
    same = sum(a == b for a, b in zip(moe["tokens"], hf_tokens, strict=True))

    ratios = {
        "moe_vs_dense_throughput": dense["seconds"] / moe["seconds"],
        "moe_vs_dense_batch1": dense["ms_per_token"] / moe["ms_per_token"],
        "moe_vs_transformers_throughput": hf_s / moe["seconds"],
        "moe_vs_transformers_batch1": hf_lat * 1e3 / moe["ms_per_token"],
    }
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    print(f"identical sequences (pdserve MoE vs transformers): {same}/{len(prompts)}")
    moe_params = sum(p.numel() for p in hf.parameters())
    dense_width = read_arch_config(dense_dir).intermediate_size
    sweep = layer_sweep(arch, dense_width, moe["device"], moe["dtype"])

    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "dtype": str(moe["dtype"]),
        "size": args.size,
        "num_experts": arch.moe.num_experts,
        "experts_per_token": arch.moe.top_k,
        "moe_params": moe_params,
        "num_prompts": args.num_prompts,
        "prompt_len_range": [args.min_len, args.max_len],
        "output_len": args.output_len,
        "num_output_tokens": num_output_tokens,
        "cached_prompt_tokens": dense["cached_tokens"] + moe["cached_tokens"],
        "seconds": {
            "pdserve_dense": dense["seconds"],
            "pdserve_moe": moe["seconds"],
            "transformers_moe": hf_s,
        },
        "batch1_ms_per_token": {
            "pdserve_dense": dense["ms_per_token"],
            "pdserve_moe": moe["ms_per_token"],
            "transformers_moe": hf_lat * 1e3,
        },
        "ratios": ratios,
        "identical_sequences": same,
        "layer_sweep": sweep,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{'cuda' if moe['device'].type == 'cuda' else 'cpu'}_{args.size}"
    (args.out_dir / f"moe_{tag}.json").write_text(json.dumps(record, indent=2) + "\n")
    seconds, latency = record["seconds"], record["batch1_ms_per_token"]
    rows = "\n".join(
        f"| {name} | {seconds[key]:.2f} s | {num_output_tokens / seconds[key]:.1f} | "
        f"{latency[key]:.2f} |"
        for name, key in (("pdserve, dense qwen3", "pdserve_dense"),
                          ("pdserve, qwen3_moe", "pdserve_moe"),
                          ("transformers, qwen3_moe", "transformers_moe"))
    )  # fmt: skip
    sweep_rows = "\n".join(
        f"| {r['tokens']} | {r['dense_ms']:.2f} | {r['moe_ms']:.2f} | {r['ratio']:.2f}x | "
        f"{r['experts_hit']} | {r['weight_mb_read']['dense']:.0f} / "
        f"{r['weight_mb_read']['moe']:.0f} |"
        for r in sweep
    )
    write_markdown(
        args.out_dir / f"moe_{tag}.md",
        f"# Mixture of experts: `python -m benchmarks.moe --size {args.size}`\n\n"
        f"{record['machine']}, {record['dtype']}, torch {record['torch']}, {record['date']}. "
        f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
        f"{args.output_len} greedy output tokens each; {arch.moe.num_experts} experts, "
        f"{arch.moe.top_k} per token, {record['moe_params'] / 1e6:.0f}M parameters.\n\n"
        "| run | batch time | output tokens/s | batch-1 ms/token |\n|---|---:|---:|---:|\n"
        f"{rows}\n\n"
        + "\n".join(f"- {name}: **{value:.2f}x**" for name, value in ratios.items())
        + f"\n- identical sequences, pdserve MoE vs transformers: {same}/{len(prompts)}\n\n"
        "One layer's MLP, dense vs sparse (random weights, same shapes):\n\n"
        "| tokens | dense ms | MoE ms | dense / MoE | experts hit | weight MB read, "
        "dense / MoE |\n|---:|---:|---:|---:|---:|---|\n" + sweep_rows + "\n",
    )
    print(f"recorded in {args.out_dir / f'moe_{tag}.json'}")


if __name__ == "__main__":
    main()
