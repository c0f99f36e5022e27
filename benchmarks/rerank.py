"""Reranking throughput: a causal LM read at its yes/no logits (``router.score_method:
token_logits``), the engine against transformers on the same weights and prompts, side by
side in one run.

    python -m benchmarks.rerank [--model DIR | --size small] [--num-documents 32]

Each run scores ``--num-documents`` documents against a new query. A pair's prompt is
laid out as a reranker's template lays it out: an instruction head, the query, the
document, a short tail; the head and the query are the pairs' shared prefix. Cases,
each the median of ``--repeats`` runs (after one warm-up run):
- transformers (baseline): ``AutoModelForCausalLM`` on batches of ``--batch`` pairs (all
  of one length, so no padding is wasted), logits at the last position only;
- the engine with the prefix cache off: every pair's every token computed;
- the engine with the prefix cache on: what it serves by default. A query's pairs share
  the head and the query; pairs scheduled after the first has cached them compute only
  their own document.
Scores (the positive token's probability) are checked against transformers'. Writes
``benchmarks/results/rerank_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.engine_throughput import make_prompts
from benchmarks.records import write_record
from benchmarks.side_by_side import add_model_args, model_dir, record_header
from engine import LLM, PoolingParams

TOKEN_IDS = (17, 23)  # (negative, positive): any two ids of the vocabulary
VOCAB = 2000  # prompts' ids are drawn below this (every made model's vocabulary holds it)


def pair_prompts(run: int, args: argparse.Namespace) -> list[list[int]]:
    """Run ``run``'s prompts: one head, a query new to this run, each document, one tail."""
    head, tail = make_prompts(2, args.head_len, args.head_len, VOCAB, seed=1)
    query = make_prompts(1, args.query_len, args.query_len, VOCAB, seed=100 + run)[0]
    documents = make_prompts(args.num_documents, args.document_len, args.document_len,
                             VOCAB, seed=2)  # fmt: skip
    return [head + query + document + tail[:8] for document in documents]


def probabilities(logits: torch.Tensor) -> list[float]:
    """[num_pairs, 2] (negative, positive) logits -> the positive token's probability."""
    return [1 / (1 + math.exp(float(n - p))) for n, p in logits.tolist()]


def transformers_scores(model, prompts: list[list[int]], batch: int) -> list[float]:
    scores = []
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            input_ids = torch.tensor(prompts[start : start + batch])
            logits = model(input_ids=input_ids, logits_to_keep=1).logits[:, -1]
            scores += probabilities(logits[:, list(TOKEN_IDS)].float())
    return scores


def engine_scores(llm: LLM, prompts: list[list[int]]) -> list[float]:
    outputs = llm.embed(prompts, PoolingParams(token_ids=TOKEN_IDS), use_tqdm=False)
    return probabilities(torch.stack([o.embedding for o in outputs]))


def timed(
    score: Callable[[list[list[int]]], list[float]], args: argparse.Namespace
) -> tuple[list[list[float]], float]:
    """Each timed run's scores, and the median time of a run (run 0 warms up)."""
    times, results = [], []
    for run in range(args.repeats + 1):
        prompts = pair_prompts(run, args)
        start = time.perf_counter()
        results.append(score(prompts))
        if run:
            times.append(time.perf_counter() - start)
    return results[1:], statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-documents", type=int, default=32)
    parser.add_argument("--head-len", type=int, default=64, help="the template's instruction")
    parser.add_argument("--query-len", type=int, default=32)
    parser.add_argument("--document-len", type=int, default=160)
    parser.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = model_dir(args)
    prompt_len = args.head_len + args.query_len + args.document_len + 8
    num_tokens = args.num_documents * prompt_len
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    expected, baseline_s = timed(lambda p: transformers_scores(reference, p, args.batch), args)
    cold = LLM(model, dtype="float32", enable_prefix_caching=False)
    warm = LLM(model, dtype="float32")
    rows = [{"case": "transformers forward (baseline)", "seconds": baseline_s,
             "vs_baseline": 1.0, "tokens_computed": num_tokens}]  # fmt: skip
    print(f"{model.name}: {args.num_documents} pairs x {prompt_len} tokens a run")
    print(f"{rows[0]['case']:<34} {baseline_s:7.3f} s   1.00x")
    worst = 0.0
    for case, llm in (("engine, prefix cache off", cold), ("engine, prefix cache on", warm)):
        computed_before = llm.engine.num_prompt_tokens_computed
        scores, seconds = timed(lambda p, llm=llm: engine_scores(llm, p), args)
        computed = (llm.engine.num_prompt_tokens_computed - computed_before) / (args.repeats + 1)
        for got, want in zip(scores, expected, strict=True):
            worst = max(worst, max(abs(g - w) for g, w in zip(got, want, strict=True)))
        rows.append({"case": case, "seconds": seconds, "vs_baseline": baseline_s / seconds,
                     "tokens_computed": round(computed)})  # fmt: skip
        print(f"{case:<34} {seconds:7.3f} s   {baseline_s / seconds:.2f}x   "
              f"{computed:,.0f} of {num_tokens:,} tokens computed", flush=True)  # fmt: skip
        assert llm.engine.leak_report() == []
    assert worst < 1e-4, f"the engine's scores differ from transformers' by {worst}"
    record = {
        **record_header(args),
        "num_documents": args.num_documents,
        "prompt_len": prompt_len,
        "shared_prefix_len": args.head_len + args.query_len,
        "transformers_batch": args.batch,
        "max_abs_diff": worst,
        "rows": rows,
    }
    stem = args.out_dir / f"rerank_{args.tag}"
    lines = [
        f"# Reranking: {args.tag}",
        "",
        f"`python -m benchmarks.rerank {' '.join(sys.argv[1:])}` ({record['model']}, "
        f"{args.num_documents} pairs x {prompt_len} tokens a run, of which "
        f"{record['shared_prefix_len']} are the head and the query all pairs share), "
        f"{record['date']}.",
        f"Machine: {record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        "float32. Same process, same prompts, a new query each run; medians; only the "
        "ratios mean anything on a shared machine.",
        f"The engine's scores differ from transformers' by at most {worst:.1e}.",
        "",
        "| case | seconds | prompt tokens computed a run | vs transformers |",
        "|---|---|---|---|",
        *(
            f"| {row['case']} | {row['seconds']:.3f} | {row['tokens_computed']:,} of "
            f"{num_tokens:,} | {row['vs_baseline']:.2f}x |"
            for row in rows
        ),
    ]
    write_record(stem, record, "\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
