"""What drafting with a separate draft model buys and costs: decode throughput with
``speculative_method: draft_model`` against the same target without drafts, on the same
prompts in the same process, the tokens asserted equal.

    python -m benchmarks.draft_model [--size small] [--k 1 2 3 4] [--repeats 3]

Two drafts, each against the same baseline:

* an oracle pair (``oracle_draft_pair``): the target's blocks write nothing (every
  ``o_proj`` and ``down_proj`` zeroed, so the model is a bigram table computed through
  all its layers), and the draft is the same table through one layer. The draft predicts
  exactly what the target samples, at 1/L of its layers' cost: the bound of what a draft
  model saves on this engine (real pairs keep 60-80% of drafts: Llama-3.2-1B for 70B).
* the made tiny llama (random weights, 2048 of the target's 8192 token ids): its drafts
  are (almost) never right, so this is the overhead of a draft that misses.

Each row times its engine and the baseline alternately, ``--repeats`` rounds, and divides
their medians; on a shared CPU machine only the ratios mean anything.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from benchmarks.offline_runs import run_all
from benchmarks.records import write_record
from benchmarks.side_by_side import RESULTS, record_header
from benchmarks.speculative import alternating_run, vs_baseline
from common.config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.models.maker import ensure_model


def oracle_draft_pair(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """(target, draft): ``model_dir`` with every block's output zeroed, and the same
    with only its first layer. Both compute ``argmax head(norm(embed(t)))`` for every
    token, so every greedy draft is right."""
    config = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias")):
            tensor.zero_()
    pair = []
    for name, num_layers in (("target", config["num_hidden_layers"]), ("draft", 1)):
        path = out / name
        path.mkdir(parents=True)
        for file in model_dir.iterdir():
            if file.suffix != ".safetensors" and file.name != "config.json":
                (path / file.name).write_bytes(file.read_bytes())
        (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
        kept = {
            key: tensor for key, tensor in tensors.items()
            if not key.startswith("model.layers.") or int(key.split(".")[2]) < num_layers
        }  # fmt: skip
        save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
        pair.append(path)
    return pair[0], pair[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--batch", type=int, default=8, help="max_num_seqs")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.model = None  # record_header's: made models
    scratch = tempfile.TemporaryDirectory(prefix="pdserve-draft-oracle-")
    target, oracle = oracle_draft_pair(ensure_model("llama", args.size), Path(scratch.name))
    missing = ensure_model("llama", "tiny")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 2000) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    base = {"max_num_seqs": args.batch, "dtype": "float32"}
    print(f"llama {args.size} (blocks zeroed): {args.requests} requests, batch {args.batch}, "
          f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens", flush=True)  # fmt: skip
    baseline = LLMEngine(target, EngineConfig(**base))
    reference = run_all(baseline, prompts, params)  # (and a warm-up)
    steps = baseline.num_steps
    run_all(baseline, prompts, params)
    rows = [{"case": "no drafts", "draft": "-", "acceptance": None,
             "steps": baseline.num_steps - steps, "speedup": 1.0}]  # fmt: skip
    cases = [("oracle: 1 layer of the target", oracle, k) for k in args.k]
    cases.append(("random: llama tiny", missing, 2))
    for label, draft, k in cases:
        config = EngineConfig(**base, speculative_method="draft_model", draft_model=str(draft),
                              num_speculative_tokens=k)  # fmt: skip
        engine = LLMEngine(target, config)
        run, baseline_s = alternating_run(baseline, engine, prompts, params, args.repeats)
        row = vs_baseline(f"{label} k={k}", baseline_s, reference, run, {"k": k})
        rows.append({**row, "draft": label, "baseline_s": baseline_s})
        del engine
    record = {**record_header(args), "model": f"llama {args.size}, blocks zeroed",
              "batch": args.batch, "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "rows": rows}  # fmt: skip
    lines = [
        "# Draft-model speculative decoding: `python -m benchmarks.draft_model`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"{record['date']}. Target: made llama {args.size} with every block's output zeroed "
        f"(a bigram table through all its layers), float32. {args.requests} requests of "
        f"{args.prompt_tokens} prompt tokens, {args.max_tokens} greedy output tokens each, "
        f"`max_num_seqs` {args.batch}. Every row produced exactly the baseline's tokens "
        "(asserted); each ran alternately with the baseline, and the speedup is the ratio "
        "of their median times.",
        "",
        "| draft | k | drafts kept | steps | speedup vs no drafts |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        kept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        k = row.get("k", "-")
        lines.append(f"| {row['draft']} | {k} | {kept} | {row['steps']} | "
                     f"{row['speedup']:.2f}x |")  # fmt: skip
    write_record(args.out_dir / f"draft_model_{args.tag}", record, "\n".join(lines) + "\n")
    print(f"wrote {args.out_dir / f'draft_model_{args.tag}'}.json and .md")
    scratch.cleanup()


if __name__ == "__main__":
    main()
