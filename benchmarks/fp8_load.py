"""What loading a quantized checkpoint costs: the same model from its own files and from an
FP8 or packed-integer copy of them, loaded side by side in one run.

    python -m benchmarks.fp8_load [--model DIR | --size small] [--scheme fp8-block] [--rounds 3]

The FP8 copy (``engine/models/fp8_maker.py``, an FP8 ``--scheme``'s layout) stores every
projection in one byte per weight, a GPTQ or AWQ copy (``int_weights_maker.py``, ``gptq``,
``awq``, ...) in 4 or 8 bits; the engine dequantizes each weight with its scales (and
zeros) to the model dtype as it reads it (``fp8_weights.py``, ``int_weights.py``). Measured per
checkpoint, alternating, ``--rounds`` times each: the files' bytes, the weights' bytes as
the engine holds them, and the load time (``load_model``: read, dequantize, place), whose
median round is kept (the fastest swung 2x between runs here: a load of ~0.2 s is at the
mercy of the page cache and a shared machine). The difference of the medians over the
number of quantized weights is the dequantization's rate. Writes
``benchmarks/results/fp8_load_<tag>`` (``int_load_<tag>`` for GPTQ / AWQ) .json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import write_record
from benchmarks.side_by_side import add_model_args, model_dir, record_header
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.arch import read_arch_config
from engine.models.checkpoint_files import safetensors_files
from engine.models.fp8_config import SCHEMES
from engine.models.fp8_maker import quantize_checkpoint
from engine.models.int_weights_config import SCHEMES as INT_SCHEMES
from engine.models.int_weights_maker import quantize_int_checkpoint
from engine.models.loader import load_model
from engine.models.weight_count import stored_tensors


def load_seconds(model: Path, device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    """(seconds to load ``model``, bytes of the weights it holds)."""
    start = time.perf_counter()
    loaded = load_model(model, read_arch_config(model), 256, TorchAttentionBackend(16),
                        device, dtype)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    held = sum(p.numel() * p.element_size() for p in loaded.parameters())
    return elapsed, held


def quantized_weight_count(model: Path, scheme: str) -> int:
    """Weights ``model``'s files store in FP8, or packed in ``scheme``'s integers."""
    if scheme in INT_SCHEMES:
        per_word = 32 // INT_SCHEMES[scheme][0]["bits"]
        stored = stored_tensors(model)
        return sum(n * per_word for name, _, n in stored if name.endswith(".qweight"))
    return sum(n for _, dtype, n in stored_tensors(model) if dtype.startswith("F8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--scheme", default="fp8-block", choices=[*SCHEMES, *INT_SCHEMES])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    source = model_dir(args)
    with tempfile.TemporaryDirectory() as tmp:
        packed = args.scheme in INT_SCHEMES
        out = Path(tmp) / "quantized"
        if packed:
            quantized = quantize_int_checkpoint(source, out, args.scheme)
        else:
            quantized = quantize_checkpoint(source, out, args.scheme)
        checkpoints = {"original": source, args.scheme: quantized}
        seconds: dict[str, list[float]] = {name: [] for name in checkpoints}
        held: dict[str, int] = {}
        for round_index in range(args.rounds):
            for name, path in checkpoints.items():
                elapsed, held[name] = load_seconds(path, device, dtype)
                seconds[name].append(elapsed)
                print(f"round {round_index + 1}: {name} {elapsed:.2f} s", flush=True)
        file_bytes = {name: sum(p.stat().st_size for p in safetensors_files(path))
                      for name, path in checkpoints.items()}  # fmt: skip
        num_quantized = quantized_weight_count(quantized, args.scheme)
    kind = "packed integer" if packed else "FP8"
    median_s = {name: statistics.median(times) for name, times in seconds.items()}
    extra_s = median_s[args.scheme] - median_s["original"]
    record = {
        **record_header(args),
        "scheme": args.scheme,
        "device": device.type,
        "dtype": str(dtype),
        "rounds": args.rounds,
        "file_bytes": file_bytes,
        "held_bytes": held,
        "quantized_weights": num_quantized,
        "load_s": seconds,
        "median_load_s": median_s,
        "quantized_vs_original": {
            "file_bytes": file_bytes[args.scheme] / file_bytes["original"],
            "held_bytes": held[args.scheme] / held["original"],
            "load_s": median_s[args.scheme] / median_s["original"],
        },
        "dequantized_weights_per_s": num_quantized / extra_s if extra_s > 0 else None,
    }
    lines = [
        f"# Loading an {kind} checkpoint: `python -m benchmarks.fp8_load --size {args.size} "
        f"--scheme {args.scheme}`",
        "",
        f"{record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"{record['date']}. {record['model']} and its {kind} copy ({args.scheme}: "
        f"{num_quantized / 1e6:.1f} M weights quantized), loaded to {dtype} on {device.type}, "
        f"alternating, {args.rounds} rounds; the median round of each.",
        "",
        "| checkpoint | file MiB | held MiB | load s (median) | load s (all) |",
        "|---|---:|---:|---:|---|",
    ]
    for name in checkpoints:
        lines.append(
            f"| {name} | {file_bytes[name] / 2**20:.1f} | {held[name] / 2**20:.1f} | "
            f"{median_s[name]:.2f} | {', '.join(f'{s:.2f}' for s in seconds[name])} |"
        )
    lines += ["", *(f"- {name} ({args.scheme} / original): **{value:.2f}x**"
                    for name, value in record["quantized_vs_original"].items())]  # fmt: skip
    rate = record["dequantized_weights_per_s"]
    lines.append(
        f"- dequantization: {rate / 1e9:.2f} G weights/s (the extra load time over the "
        "quantized weights)"
        if rate
        else "- dequantization: within the load time's noise"
    )
    name = f"{'int' if packed else 'fp8'}_load_{args.tag}"
    write_record(args.out_dir / name, record, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
