"""Embedding throughput: the engine's pooling against transformers' forward pass (what
sentence-transformers runs), on the same weights and prompts, side by side in one run.

    python -m benchmarks.embeddings [--model DIR | --size small] [--num-prompts 32]

Cases, each timed as the median of ``--repeats`` runs:
- transformers (baseline): ``AutoModel`` on batches of ``--batch`` prompts (all of one
  length, so no padding is wasted), the last token's hidden state, normalized;
- the engine's ``embed``, with the prefix cache off (every prompt token computed);
- the engine's ``generate`` with ``max_tokens=1``: what serving embeddings without
  pooling would cost (the LM head and the sampler on top of the same prefill);
- the engine's ``embed`` with the prefix cache on, the prompts seen before (a re-sent
  document): only the tokens after the last cached block are computed.
The engine's vectors are checked against transformers' (max abs difference printed).
Writes ``benchmarks/results/embeddings_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.engine_throughput import make_prompts
from benchmarks.records import rate_rows, write_record
from benchmarks.side_by_side import add_model_args, model_dir, record_header
from engine import LLM, SamplingParams


def timed(run: Callable[[], object], repeats: int) -> tuple[object, float]:
    """``run()``'s last result and its median time (after one warm-up run)."""
    run()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def transformers_embed(model, prompts: list[list[int]], batch: int) -> torch.Tensor:
    """[num_prompts, hidden] unit vectors, ``batch`` prompts per forward pass."""
    vectors = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            input_ids = torch.tensor(prompts[start : start + batch])
            hidden = model(input_ids=input_ids).last_hidden_state[:, -1]
            vectors.append(torch.nn.functional.normalize(hidden.float(), dim=-1))
    return torch.cat(vectors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModel

    model = model_dir(args)
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.prompt_len, 2000, seed=0)
    num_tokens = len(prompts) * args.prompt_len
    reference = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    cold = LLM(model, dtype="float32", enable_prefix_caching=False)
    warm = LLM(model, dtype="float32")
    one_token = SamplingParams(max_tokens=1, temperature=0)
    expected, baseline_s = timed(lambda: transformers_embed(reference, prompts, args.batch),
                                 args.repeats)  # fmt: skip
    cases: list[tuple[str, Callable[[], object]]] = [
        ("engine embed", lambda: cold.embed(prompts, use_tqdm=False)),
        ("engine generate, max_tokens 1",
         lambda: cold.generate(prompts, one_token, use_tqdm=False)),
        ("engine embed, prompts cached", lambda: warm.embed(prompts, use_tqdm=False)),
    ]  # fmt: skip
    rows = [{"case": "transformers forward (baseline)", "seconds": baseline_s, "vs_baseline": 1.0}]
    print(f"{model.name}: {len(prompts)} prompts x {args.prompt_len} tokens")
    print(f"{rows[0]['case']:<34} {baseline_s:7.3f} s   1.00x")
    worst = 0.0
    for case, run in cases:
        outputs, seconds = timed(run, args.repeats)
        if "embed" in case:
            got = torch.stack([o.embedding for o in outputs])
            worst = max(worst, (got - expected).abs().max().item())
        rows.append({"case": case, "seconds": seconds, "vs_baseline": baseline_s / seconds})
        print(f"{case:<34} {seconds:7.3f} s   {baseline_s / seconds:.2f}x", flush=True)
    assert worst < 1e-4, f"the engine's vectors differ from transformers' by {worst}"
    assert cold.engine.leak_report() == [] and warm.engine.leak_report() == []
    record = {
        **record_header(args),
        "num_prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "transformers_batch": args.batch,
        "max_abs_diff": worst,
        "rows": rows,
    }
    stem = args.out_dir / f"embeddings_{args.tag}"
    lines = [
        f"# Embeddings: {args.tag}",
        "",
        f"`python -m benchmarks.embeddings {' '.join(sys.argv[1:])}` ({record['model']}, "
        f"{len(prompts)} prompts x {args.prompt_len} tokens, {num_tokens} tokens a run), "
        f"{record['date']}.",
        f"Machine: {record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        "float32. Same process, same prompts; medians; only the ratios mean anything on a "
        "shared machine.",
        f"The engine's vectors differ from transformers' by at most {worst:.1e}.",
        "",
        "| case | seconds | tokens/s | vs transformers |",
        "|---|---|---|---|",
        *rate_rows(rows, num_tokens),
    ]
    write_record(stem, record, "\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
