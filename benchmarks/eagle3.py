"""What drafting with an EAGLE-3 head buys and costs: decode throughput with
``speculative_method: eagle3`` against the same target without drafts, on the same
prompts in the same process, the tokens asserted equal.

    python -m benchmarks.eagle3 [--size small] [--k 1 2 3 4] [--repeats 3]

The target is a made llama as a bigram table (``draft_model.bigram_checkpoint``: every
block's output zeroed). Two heads, each against the same baseline:

* an oracle head (``oracle_eagle3_head``) that drafts exactly what the target samples:
  the bound of what EAGLE-3 saves on this engine (released heads keep 60-80% of drafts,
  3-4 tokens a step at k = 5 on Llama-3.1-8B, by EAGLE-3's report);
* a random head (``make_eagle3_head``): drafts (almost) never right, its overhead.

Each row times its engine and the baseline alternately, ``--repeats`` rounds, and divides
their medians; on a shared CPU machine only the ratios mean anything.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.draft_model import bigram_checkpoint
from benchmarks.drafters import compare_drafters, drafter_parser
from engine.models.eagle3_maker import make_eagle3_head
from engine.models.maker import ensure_model

# The q and k biases: every head's query and key, so attention scores are
# ``scale * |c|^2 * sum_i cos(theta_i * (m - n))``, highest by far at m = n (itself).
_SELF_ATTENTION_BIAS = 100.0


def oracle_eagle3_head(target: Path, out: Path) -> Path:
    """An EAGLE-3 head for ``target`` (a bigram table, ``bigram_checkpoint``) whose every
    greedy draft is right. Its features never count (a zero ``hidden_norm``, which with
    ``norm_before_residual`` is the residual too), its MLP writes nothing,
    and its attention attends to its own position only (constant q and k biases, so the
    rotary embedding's phase peaks there), passing the first ``num_kv_heads * head_dim``
    coordinates of the normed input embedding through. Its head's row for each token is
    that token's passed part, unit length, so the head's argmax is the token it was fed,
    ``t_{q+1}``; and ``d2t`` maps each token to the target's bigram successor, so the
    draft is ``t_{q+2}``, exactly what the target will sample. Drafts after the first
    feed it the previous draft: each is right too."""
    config = json.loads((target / "config.json").read_text())
    make_eagle3_head(
        target, out, config["vocab_size"], attention_bias=True, norm_before_residual=True
    )
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    kv_size = num_kv_heads * head_dim
    weights = load_file(str(target / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    lm_head = weights.get("lm_head.weight", embed)

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    successor = (rms(embed) * weights["model.norm.weight"]) @ lm_head.T  # [vocab, vocab]
    successor = successor.argmax(dim=-1)
    passed = rms(embed)[:, :kv_size]  # what the attention passes on, per token
    tensors = load_file(str(out / "model.safetensors"))
    prefix = "midlayer."
    zero = ("fc.weight", "midlayer.mlp.down_proj.weight")
    for name in zero + tuple(
        f"{prefix}self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")
    ):
        tensors[name].zero_()
    tensors[f"{prefix}self_attn.q_proj.bias"].fill_(_SELF_ATTENTION_BIAS)
    tensors[f"{prefix}self_attn.k_proj.bias"].fill_(_SELF_ATTENTION_BIAS)
    tensors[f"{prefix}self_attn.v_proj.weight"][:, :kv_size] = torch.eye(kv_size)
    o_proj = tensors[f"{prefix}self_attn.o_proj.weight"]  # [hidden, q heads * head_dim]
    group = num_heads // num_kv_heads
    for kv_head in range(num_kv_heads):  # the first query head reading each KV head
        rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        cols = slice(kv_head * group * head_dim, (kv_head * group + 1) * head_dim)
        o_proj[rows, cols] = torch.eye(head_dim)
    for name in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{prefix}{name}.weight"].fill_(1.0)
    # The residual is the normed features (norm_before_residual): zero, so each pass's
    # state is what its attention passed, not the sum of the passes before it.
    tensors[f"{prefix}hidden_norm.weight"].zero_()
    tensors["norm.weight"].fill_(1.0)
    unit = passed / passed.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (zero rows: padding)
    tensors["lm_head.weight"] = torch.cat((unit, torch.zeros(len(unit), hidden - kv_size)), dim=1)
    tensors["d2t"] = successor - torch.arange(len(successor))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    args = drafter_parser(__doc__.split("\n")[0]).parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-eagle3-") as scratch:
        target = bigram_checkpoint(ensure_model("llama", args.size), Path(scratch) / "target")
        oracle = oracle_eagle3_head(target, Path(scratch) / "oracle")
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        random_head = make_eagle3_head(target, Path(scratch) / "random", vocab // 4)
        cases = [("oracle", oracle, k) for k in args.k]
        cases.append((f"random ({vocab // 4} draft ids)", random_head, 2))
        compare_drafters(args, target, "eagle3", cases, "eagle3",
                         "EAGLE-3 speculative decoding", "head")  # fmt: skip


if __name__ == "__main__":
    main()
