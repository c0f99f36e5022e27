"""Prompts with images against text prompts of the same length, and the same image-bearing
prompts again (a chat's next turn re-sends its images), side by side in one run.

    python -m benchmarks.images [--model DIR | --size small] [--arch gemma3_mm] [--num-prompts 16]

Each prompt is ``--text-tokens`` of text around ``--images`` images (the made LLaVA: 16
placeholder tokens each, from a 3-layer CLIP tower over 28 x 28 pixels, far smaller than
LLaVA-1.5's 24 layers over 336 x 336, so the encoder's share here is a lower bound; the
made Gemma 3: 16 pooled from a 2-layer SigLIP over 56 x 56, each image's tokens attending
to each other; the made Qwen2.5-VL: by size, 64 for a 256 x 256 image at its pixel bound,
from a 4-layer windowed tower, at 3-D rotary positions; the made Qwen3-VL: 64 for a
256 x 256 image, from a 4-layer tower with DeepStack rows for 3 language-model layers).
Cases, each the median of ``--repeats`` rounds (the cases alternate within a round, after
a warm-up round), a run being all prompts with ``max_tokens`` 1 (the prompt's work and its
first token):
- text prompts of the same token count, prefix cache off (the baseline);
- the prompts with images, prefix and encoder caches off: every image decoded, encoded
  and prefilled;
- the same prompts again with the encoder cache only: every image decoded and prefilled,
  none encoded (what the encoder costs is the difference);
- the same prompts again, prefix cache on and warm: what a chat's next turn costs when
  its images were seen (their blocks are keyed by the images' digests).
The engine's first tokens with images are checked equal with and without the cache.
Writes ``benchmarks/results/images_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time

import numpy as np

from benchmarks.records import rate_rows, write_record
from benchmarks.side_by_side import add_model_args, record_header
from engine import LLM, SamplingParams


def png(seed: int, height: int, width: int) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=2, help="images per prompt")
    parser.add_argument("--image-size", type=int, default=256, help="pixels of a side")
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument(
        "--arch",
        choices=("llava", "gemma3_mm", "qwen2_5_vl", "qwen3_vl"),
        default="llava",
        help="the made model's layout (without --model)",
    )
    args = parser.parse_args()
    from engine.models.maker import ensure_model

    model = args.model or ensure_model(args.arch, args.size)
    cold = LLM(model, dtype="float32", enable_prefix_caching=False, encoder_cache_bytes=0)
    encoder_cached = LLM(model, dtype="float32", enable_prefix_caching=False)
    warm = LLM(model, dtype="float32")
    vision = cold.engine.arch.vision
    assert vision is not None, f"{model} takes no images"
    rng = np.random.default_rng(0)
    prompts, texts = [], []
    for i in range(args.num_prompts):
        text = rng.integers(5, 2000, args.text_tokens).tolist()
        cut = sorted(rng.choice(np.arange(1, args.text_tokens), args.images, replace=False))
        ids = list(text)
        for offset in reversed(cut):  # one marker each, made the images' sequences by LLM
            ids.insert(int(offset), vision.marker_token_id)
        images = [png(i * 100 + j, args.image_size, args.image_size) for j in range(args.images)]
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
        expanded = cold._with_images(prompts[-1])[0]
        texts.append(rng.integers(5, 2000, len(expanded)).tolist())  # as many tokens
    # Each image's placeholders (by its size under dynamic resolution: all are one size).
    tokens_per_image = expanded.count(vision.image_token_id) // args.images
    num_tokens = sum(len(t) for t in texts)
    first = SamplingParams(max_tokens=1, temperature=0)

    def tokens(outputs) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in outputs]

    cases = {
        "text": lambda: cold.generate(texts, first, use_tqdm=False),
        "uncached": lambda: cold.generate(prompts, first, use_tqdm=False),
        "encoder cached": lambda: encoder_cached.generate(prompts, first, use_tqdm=False),
        "cached": lambda: warm.generate(prompts, first, use_tqdm=False),
    }
    outputs = {name: run() for name, run in cases.items()}  # warm-up; the first turn
    encoded_before = [llm.engine.runner.num_images_encoded for llm in (encoder_cached, warm)]
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, run in cases.items():
            start = time.perf_counter()
            outputs[name] = run()
            seconds[name].append(time.perf_counter() - start)
    encoded_cached = sum(
        llm.engine.runner.num_images_encoded - before
        for llm, before in zip((encoder_cached, warm), encoded_before, strict=True)
    )
    for name in ("encoder cached", "cached"):
        assert tokens(outputs[name]) == tokens(outputs["uncached"]), f"{name} changed a token"
    for llm in (cold, encoder_cached, warm):
        assert llm.engine.leak_report() == []
    baseline_s, uncached_s, encoder_s, cached_s = (statistics.median(seconds[n]) for n in cases)
    rows = [
        {"case": "text prompts, same token count (baseline)", "seconds": baseline_s},
        {"case": "with images, no caches", "seconds": uncached_s},
        {"case": "with images again, encoder cache only", "seconds": encoder_s},
        {"case": "with images again, cached (a chat's next turn)", "seconds": cached_s},
    ]
    for row in rows:
        row["vs_baseline"] = baseline_s / row["seconds"]
    print(f"{model}: {len(prompts)} prompts of {args.text_tokens} text tokens and "
          f"{args.images} images ({tokens_per_image} tokens each)")  # fmt: skip
    for row in rows:
        print(f"{row['case']:<48} {row['seconds']:7.3f} s   {row['vs_baseline']:.2f}x")
    record = {
        **record_header(args),
        "model": str(args.model or f"{args.arch} {args.size}"),
        "num_prompts": len(prompts),
        "text_tokens": args.text_tokens,
        "images_per_prompt": args.images,
        "image_size": args.image_size,
        "tokens_per_image": tokens_per_image,
        "images_encoded_when_cached": encoded_cached,  # by the two cached engines
        "rows": rows,
    }
    stem = args.out_dir / f"images_{args.tag}"
    lines = [
        f"# Images: {args.tag}",
        "",
        f"`python -m benchmarks.images {' '.join(sys.argv[1:])}` ({record['model']}, "
        f"{len(prompts)} prompts of {args.text_tokens} text tokens and {args.images} "
        f"{args.image_size} x {args.image_size} PNG images of {tokens_per_image} "
        f"tokens each, {num_tokens} prompt tokens a run; max_tokens 1), {record['date']}.",
        f"Machine: {record['machine']}, {record['cores']} cores, torch {record['torch']}, "
        f"float32. Same process, the cases alternating in {args.repeats} rounds; medians; "
        "only the ratios mean anything on a shared machine.",
        f"Images encoded in the runs with a cache: {encoded_cached}.",
        "",
        "| case | seconds | prompt tokens/s | vs text |",
        "|---|---|---|---|",
        *rate_rows(rows, num_tokens),
    ]
    write_record(stem, record, "\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
