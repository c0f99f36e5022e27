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

import json
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from benchmarks.drafters import compare_drafters, drafter_parser
from engine.models.maker import ensure_model


def bigram_checkpoint(model_dir: Path, out: Path, num_layers: int | None = None) -> Path:
    """``model_dir`` (a made model, one file) with every block's output zeroed (attention's
    ``o_proj``, the MLPs' ``down_proj``), cut to its first ``num_layers`` (None: all), at
    ``out``: a bigram table, ``argmax head(norm(embed(t)))``, computed through its layers."""
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = num_layers or config["num_hidden_layers"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    out.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (out / file.name).write_bytes(file.read_bytes())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    kept = {
        key: tensor.zero_() if key.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias"))
        else tensor
        for key, tensor in tensors.items()
        if not key.startswith("model.layers.") or int(key.split(".")[2]) < num_layers
    }  # fmt: skip
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def oracle_draft_pair(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """(target, draft): ``model_dir`` as a bigram table (``bigram_checkpoint``), and the
    same through only its first layer. Both compute ``argmax head(norm(embed(t)))`` for
    every token, so every greedy draft is right."""
    return bigram_checkpoint(model_dir, out / "target"), bigram_checkpoint(
        model_dir, out / "draft", 1
    )


def main() -> None:
    args = drafter_parser(__doc__.split("\n")[0]).parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-draft-oracle-") as scratch:
        target, oracle = oracle_draft_pair(ensure_model("llama", args.size), Path(scratch))
        cases = [("oracle: 1 layer of the target", oracle, k) for k in args.k]
        cases.append(("random: llama tiny", ensure_model("llama", "tiny"), 2))
        compare_drafters(args, target, "draft_model", cases, "draft_model",
                         "Draft-model speculative decoding", "draft")  # fmt: skip


if __name__ == "__main__":
    main()
