"""What drafting with the MTP layer buys and costs: decode throughput with
``speculative_method: mtp`` against the same engine settings without drafts, on the same
prompts in the same process, the tokens asserted equal.

    python -m benchmarks.mtp [--arch deepseek_v3|glm4_moe|qwen3_5] [--k 1 2 3] [--repeats 3] ...

(``qwen3_5``: the hybrid model with an MTP layer added as its releases store it, whose
verifying steps keep the linear-attention states after each token.)

Two models, each against its own baseline:

* the made checkpoint (random weights): its MTP layer guesses at random, so (almost) no
  draft is kept. This is the overhead: the MTP pass after every step, and the drafts the
  budget still lets through. ``k=0`` runs the pass without drafting (what a prefill
  worker pays to write the prompt's MTP KV).
* an oracle of it (``oracle_mtp_checkpoint``): every block's output zeroed, so the model
  is a bigram table, and an MTP layer that predicts exactly what the model will sample.
  Every draft is kept: the upper bound of what MTP saves on this engine. DeepSeek reports
  85-90% of first drafts kept with V3's own MTP layer; a trained layer lies between.

Each row times its engine and the baseline alternately, ``--repeats`` rounds, and divides
their medians; on a shared CPU machine only the ratios mean anything, and a tiny model's
step is mostly host overhead, which the MTP pass adds to.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.offline_runs import run_all
from benchmarks.speculative import alternating_run, vs_baseline
from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.models.maker import add_qwen_mtp_layer, ensure_model

RESULTS = Path(__file__).parent / "results"


def oracle_mtp_checkpoint(model_dir: Path, out: Path) -> Path:
    """``model_dir`` (a checkpoint with an MTP layer, one file) with every block's output
    zeroed (``_bigram_copy``), so the model is a bigram table: the next token is ``argmax
    head(norm(embed(t)))``. Its MTP layer, zeroed alike, passes on the embedding of the
    token after its position (``eh_proj = [I, 0]``, unit ``enorm``) to the model's own
    final norm and head, so it predicts the token after that one exactly as the model
    will: every greedy draft is right."""
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    prefix = f"model.layers.{num_layers}."
    tensors = _bigram_copy(model_dir, out)
    hidden = tensors["model.norm.weight"].shape[0]
    tensors[prefix + "eh_proj.weight"] = _first_half(hidden)
    tensors[prefix + "enorm.weight"] = torch.ones(hidden)
    tensors[prefix + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def oracle_qwen_mtp_checkpoint(model_dir: Path, out: Path) -> Path:
    """The same oracle for a Qwen3.5 checkpoint with its MTP layer stored as ``mtp.*``
    (``maker.add_qwen_mtp_layer``): ``mtp.fc = [I, 0]``, a unit ``pre_fc_norm_embedding``
    (Qwen3.5's norms scale by 1 + weight) and the model's final norm as ``mtp.norm``."""
    tensors = _bigram_copy(model_dir, out)
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = _first_half(hidden)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _bigram_copy(model_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """``model_dir``'s files but its weights copied into ``out`` (created), and its
    weights (one file) with every block's output zeroed: attention's ``o_proj``, a
    delta-rule layer's ``out_proj``, the MLPs' and experts' down projections."""
    out.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    outputs = ("o_proj.weight", "o_proj.bias", "out_proj.weight", "down_proj.weight")
    for name, tensor in tensors.items():
        if name.endswith(outputs):
            tensor.zero_()
    return tensors


def _first_half(hidden: int) -> torch.Tensor:
    """[I, 0]: of [embedding, hidden state], the embedding ([hidden, 2 * hidden])."""
    return torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown CPU"


def _markdown(record: dict) -> str:
    lines = [
        f"# MTP drafts ({record['model']}): CPU",
        "",
        f"`python -m benchmarks.mtp {record.get('argv', '')}` (raw: "
        f"`{record['json_name']}`), {record['date'][:10]}.",
        f"Machine: {record['machine']}. {record['requests']} requests of "
        f"{record['prompt_tokens']} prompt tokens, {record['max_tokens']} greedy output "
        f"tokens each, `max_num_seqs` {record['batch']}. Every row produced exactly its "
        "baseline's tokens (asserted). Each row ran alternately with its baseline; the "
        "speedup is the ratio of their median times.",
        "",
        "| model | case | drafts kept | steps | speedup vs no drafts |",
        "|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        kept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        lines.append(f"| {row['model']} | {row['case']} | {kept} | {row['steps']} | "
                     f"{row['speedup']:.2f}x |")  # fmt: skip
    lines += [
        "",
        "The random MTP rows are the overhead when drafts miss: the MTP pass after every",
        "step (k=0 is the pass alone, what a prefill worker pays), plus the drafts the",
        "budget lets through. On this 4-layer model the MTP layer is a fifth of the layers",
        "(on DeepSeek-V3 one in 62). The oracle rows are the bound when every draft is",
        "kept: 1 + k tokens a step. On this CPU a step costs in proportion to its tokens",
        "(compute-bound), so the speedup is well below the step ratio; on a GPU decoding",
        "is memory-bound and verifying k more tokens is nearly free.",
    ]
    if record["model"].startswith("qwen3_5"):
        lines += [
            "",
            "A hybrid model (3 of its 4 layers gated delta rule) verifies drafts with the",
            "recurrence one token at a time in those layers, keeping the states after each",
            "(a few small operations per token and layer, all requests together): on this",
            "tiny model, where a step is mostly that kind of host overhead, the oracle's",
            "gain is smaller than a dense model's.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=["deepseek_v3", "glm4_moe", "qwen3_5"],
                        default="deepseek_v3")  # fmt: skip
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--batch", type=int, default=16, help="max_num_seqs")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    made = ensure_model(args.arch, args.size)
    out_dir = Path(args.out_dir)
    scratch = tempfile.TemporaryDirectory(prefix="pdserve-mtp-oracle-")
    if args.arch == "qwen3_5":  # a hybrid model: its MTP layer added as Qwen3.5's releases
        made = add_qwen_mtp_layer(made, Path(scratch.name) / "with-mtp")
        oracle = oracle_qwen_mtp_checkpoint(made, Path(scratch.name) / "oracle")
    else:
        oracle = oracle_mtp_checkpoint(made, Path(scratch.name) / "oracle")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 2000) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    base = {"max_num_seqs": args.batch, "dtype": "float32"}
    rows = []
    print(f"{args.arch} {args.size}: {args.requests} requests, batch {args.batch}, "
          f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens", flush=True)  # fmt: skip
    for label, model, ks in (("random MTP", made, [0, *args.k]), ("oracle MTP", oracle, args.k)):
        baseline = LLMEngine(model, EngineConfig(**base))
        reference = run_all(baseline, prompts, params)  # (and a warm-up)
        steps = baseline.num_steps
        run_all(baseline, prompts, params)
        rows.append({"model": label, "case": "no drafts", "acceptance": None,
                     "steps": baseline.num_steps - steps, "speedup": 1.0})  # fmt: skip
        for k in ks:
            engine = LLMEngine(model, EngineConfig(**base, speculative_method="mtp",
                                                   num_speculative_tokens=k))  # fmt: skip
            name = f"mtp k={k}" + (" (MTP KV only)" if k == 0 else "")
            run, baseline_s = alternating_run(baseline, engine, prompts, params, args.repeats)
            row = vs_baseline(f"{label} {name}", baseline_s, reference, run, {"k": k})
            rows.append({**row, "model": label, "case": name, "baseline_s": baseline_s})
            del engine
    machine = (f"{_cpu_name()} ({platform.machine()}, {os.cpu_count()} cores), "
               f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
               "float32, torch attention backend")  # fmt: skip
    stem = f"mtp_{args.tag}"
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine,
        "model": f"{args.arch} {args.size}", "batch": args.batch, "requests": args.requests,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "json_name": f"{stem}.json", "rows": rows,
        "argv": " ".join(sys.argv[1:]),
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(_markdown(record))
    print(f"wrote {out_dir / stem}.json and .md")
    scratch.cleanup()


if __name__ == "__main__":
    main()
