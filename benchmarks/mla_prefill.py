"""What expanding the latents buys a DeepSeek prefill: the same prompts through the same
engine with latent attention absorbed everywhere (the first build) and with each prompt
segment in its cheaper form (``LatentAttention.expanded_is_cheaper``: a whole prompt
expands), side by side in one run, alternating.

    python -m benchmarks.mla_prefill [--prompt-lens 512 2048] [--repeats 3]

The model has DeepSeek-V3's per-head attention dims (128 nope + 64 rope query/key dims,
128 value dims, a 512 + 64 latent) with fewer heads and layers and dense MLPs, so the
attention's share of a prefill is a real model's, within this CPU's reach. Measured per
form: each prompt's prefill time (one output token, no prefix caching), median of the
repeats, and the tokens each form gave (they must agree). Writes
``benchmarks/results/mla_prefill_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.engine_throughput import make_prompts
from benchmarks.records import write_record
from benchmarks.side_by_side import RESULTS, record_header
from engine import LLM, SamplingParams
from engine.attention.backend import LatentAttention

FORMS = ("absorbed", "chosen")


def make_checkpoint(out: Path, num_heads: int, num_layers: int) -> Path:
    """A random DeepSeek-V3 checkpoint of V3's attention dims (``num_heads`` heads of
    them), dense MLPs, and the made tiny model's tokenizer."""
    import torch
    import transformers

    from engine.models.maker import ensure_model

    tokenizer_dir = ensure_model("deepseek_v3", "tiny")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    hidden = 128 * num_heads
    config = transformers.DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, q_lora_rank=512, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=num_layers, max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def absorbed_everywhere() -> Iterator[None]:
    """Every segment attends absorbed, as the first build did."""
    chosen = LatentAttention.expanded_is_cheaper
    LatentAttention.expanded_is_cheaper = lambda self, query_len, seq_len: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        LatentAttention.expanded_is_cheaper = chosen  # type: ignore[method-assign]


def prefill_seconds(llm: LLM, prompt: list[int], form: str) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=1, temperature=0)
    context = absorbed_everywhere() if form == "absorbed" else contextlib.nullcontext()
    with context:
        start = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start, output.outputs[0].token_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="default: float32 on a CPU, bfloat16 on CUDA")  # fmt: skip
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    workdir = Path(tempfile.mkdtemp(prefix="mla-prefill-"))
    try:
        model = make_checkpoint(workdir / "model", args.num_heads, args.num_layers)
        longest = max(args.prompt_lens)
        llm = LLM(model, dtype=dtype, enable_prefix_caching=False,
                  max_num_batched_tokens=longest, max_model_len=longest + 16)  # fmt: skip
        rows = []
        for prompt_len in args.prompt_lens:
            (prompt,) = make_prompts(1, prompt_len, prompt_len, 2000, seed=prompt_len)
            prefill_seconds(llm, prompt, "chosen")  # warm-up
            times: dict[str, list[float]] = {form: [] for form in FORMS}
            tokens: dict[str, list[int]] = {}
            for _ in range(args.repeats):
                for form in FORMS:
                    seconds, tokens[form] = prefill_seconds(llm, prompt, form)
                    times[form].append(seconds)
            medians = {form: statistics.median(times[form]) for form in FORMS}
            rows.append({
                "prompt_len": prompt_len,
                "absorbed_s": medians["absorbed"],
                "chosen_s": medians["chosen"],
                "speedup": medians["absorbed"] / medians["chosen"],
                "same_tokens": tokens["absorbed"] == tokens["chosen"],
            })  # fmt: skip
            print(f"prompt {prompt_len}: absorbed {medians['absorbed']:.3f} s, chosen "
                  f"{medians['chosen']:.3f} s, {rows[-1]['speedup']:.2f}x", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    record = {
        **record_header(argparse.Namespace(model=None, size="")),
        "model": f"DeepSeek-V3 attention dims, {args.num_heads} heads, {args.num_layers} layers",
        "dtype": dtype,
        "repeats": args.repeats,
        "rows": rows,
    }
    lines = [
        f"# MLA prefill: absorbed everywhere vs the cheaper form per segment ({args.tag})",
        "",
        f"{record['machine']}, torch {record['torch']}, {record['date']}; {record['model']}, "
        f"{dtype}, median of {args.repeats} alternating runs per cell.",
        "",
        "| prompt tokens | absorbed s | chosen (expanded) s | speedup | same tokens |",
        "|---|---|---|---|---|",
        *(f"| {r['prompt_len']} | {r['absorbed_s']:.3f} | {r['chosen_s']:.3f} | "
          f"{r['speedup']:.2f}x | {r['same_tokens']} |" for r in rows),
    ]  # fmt: skip
    write_record(args.out_dir / f"mla_prefill_{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
