"""Micro-benchmarks of the Triton attention kernels, beside torch's SDPA on the same shapes.

Decode: achieved bandwidth (bytes of K/V read / time) against the device's peak, for batch
1, 16, 64 at contexts 512, 2k, 8k. Prefill: TFLOP/s of one causal prompt of 2k and 8k tokens.
The baseline is ``scaled_dot_product_attention`` over dense (not paged) K/V of the same shape.
Shapes are Llama-3-8B's attention: 32 query heads, 8 KV heads of dim 128, bf16, block size 16.

    python benchmarks/kernels.py [--json out.json] [--md out.md]   # the table
    python benchmarks/kernels.py --sweep --json sweep.json          # tune launch shapes
    python benchmarks/kernels.py --sweep-targets --json t.json      # only the open targets
    python benchmarks/kernels.py --kv-cache-dtype fp8 --md fp8.md     # FP8 paged cache

With ``--kv-cache-dtype fp8`` (or ``fp8_e5m2``) the paged cache holds FP8 (the engine's
``engine.kv_cache_dtype``) and the kernel reads half the bytes; SDPA stays dense bf16.
What the FP8 cache buys is the triton column against the bf16 table's on the same device.

Needs CUDA, torch and triton only. Device times are medians of ``triton.testing.do_bench``
over CUDA-graph replays (L2 flushed before each); "eager" is the wall time per call launched
eagerly back to back, where host launch overhead shows. The paged cache's blocks are handed
out in a random order.

Each decode row also times, the same way, a plain read of the same number of contiguous
bytes (``amax`` over one tensor): what any kernel launched from a graph can reach at that
size, launch and ramp-up included. The header gives the floor: an empty graph's replay.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention_config import LaunchConfig
from kernels.paged_attention import decode_attention, paged_attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
PEAK_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # HBM3 / HBM3e datasheet peaks
DECODE_SHAPES = [(b, c) for b in (1, 16, 64) for c in (512, 2048, 8192)]
PREFILL_TOKENS = (2048, 8192)
KV_DTYPES = {"auto": DTYPE, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# --sweep-targets: (block_m, tile_n, num_warps, num_stages) beyond the full sweep's.
TARGET_DECODE_SHAPES = [
    (16, 64, 4, 2), (16, 32, 4, 4), (16, 64, 4, 4), (16, 64, 2, 2), (16, 32, 2, 3),
    (16, 64, 2, 4), (16, 64, 8, 3), (16, 128, 8, 3),
]  # fmt: skip
FP8_DECODE_SHAPES = [(16, 128, 4, 2), (16, 128, 4, 3), (16, 256, 4, 2), (16, 256, 8, 2)]
TARGET_PREFILL_SHAPES = [
    (64, 64, 4, 2), (128, 32, 4, 2), (64, 32, 4, 4), (64, 64, 8, 2), (128, 64, 8, 4),
    (128, 128, 8, 4), (256, 64, 8, 4), (256, 32, 8, 4), (128, 32, 4, 4),
]  # fmt: skip


@dataclass
class Result:
    kind: str  # "decode" | "prefill"
    batch: int
    tokens: int  # context (decode) or prompt length (prefill)
    triton_ms: float
    sdpa_ms: float
    work: float  # bytes (decode) or FLOPs (prefill)
    config: dict = field(default_factory=dict)
    triton_eager_ms: float = float("nan")
    read_ms: float = float("nan")  # decode: amax over `work` contiguous bytes, same timing


def bench(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median device time (ms) of one call replayed from a CUDA graph: launch overhead out,
    L2 flushed before each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")


def eager_ms(fn: Callable[[], object], calls: int = 100) -> float:
    """Wall time (ms) per call launched eagerly back to back: the larger of host launch
    overhead and device time, i.e. what a caller without CUDA graphs pays."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def contiguous_read_ms(num_bytes: int) -> float:
    """Device time of reading ``num_bytes`` contiguous bytes (one ``amax``), timed as
    ``bench`` times the kernels: a streaming kernel's best at this size."""
    data = torch.randn(num_bytes // DTYPE.itemsize, dtype=DTYPE, device="cuda")
    return bench(lambda: torch.amax(data))


def floor_ms() -> float:
    """Device time of a graph holding one tiny kernel: what every timed replay pays."""
    one = torch.zeros(1, device="cuda")
    return bench(lambda: one.add_(1.0))


def paged_cache(
    batch: int, context: int, kv_dtype: torch.dtype = DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding ``batch`` contexts in shuffled blocks, and their block table."""
    per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, dtype=DTYPE, device="cuda").to(kv_dtype)
    order = torch.randperm(num_blocks - 1, device="cuda")[: batch * per_seq] + 1
    return cache, order.view(batch, per_seq).to(torch.int32)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> float:
    """Best of SDPA with native GQA and with K/V expanded to every query head."""
    times = []
    for gqa in (True, False):
        k, v = key, value
        if not gqa:
            k = key.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
            v = value.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
        try:
            times.append(
                bench(
                    lambda k=k, v=v, gqa=gqa: F.scaled_dot_product_attention(
                        query, k, v, is_causal=causal, enable_gqa=gqa
                    )
                )
            )
        except RuntimeError as exc:
            print(f"  sdpa enable_gqa={gqa} failed: {exc}", file=sys.stderr)
    return min(times)


def decode_case(
    batch: int,
    context: int,
    config: LaunchConfig | None = None,
    num_splits: int | None = None,
    with_sdpa: bool = True,
    rep_ms: int = 100,
    kv_dtype: torch.dtype = DTYPE,
) -> Result:
    cache, table = paged_cache(batch, context, kv_dtype)
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5

    def run() -> torch.Tensor:
        return decode_attention(
            query, cache, seq_lens, table, scale,
            max_seq_len=context, num_splits=num_splits, config=config,
        )  # fmt: skip

    ms = bench(run, rep_ms)
    sdpa_ms = eager = float("nan")
    if with_sdpa:
        eager = eager_ms(run)
        dense = torch.randn(2, batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device="cuda")
        sdpa_ms = sdpa(query[:, :, None], dense[0], dense[1], causal=False)
        del dense
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    chosen = asdict(config) if config else {}
    chosen |= {"splits": num_splits}
    read = contiguous_read_ms(kv_bytes) if with_sdpa else float("nan")
    return Result("decode", batch, context, ms, sdpa_ms, kv_bytes, chosen, eager, read)


def prefill_case(
    tokens: int,
    config: LaunchConfig | None = None,
    with_sdpa: bool = True,
    rep_ms: int = 100,
    kv_dtype: torch.dtype = DTYPE,
) -> Result:
    cache, table = paged_cache(1, tokens, kv_dtype)
    query = torch.randn(tokens, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5

    def run() -> torch.Tensor:
        return paged_attention(query, cache, starts, seq_lens, table, scale, prefill=config)

    ms = bench(run, rep_ms)
    sdpa_ms = eager = float("nan")
    if with_sdpa:
        eager = eager_ms(run)
        q = query.transpose(0, 1)[None].contiguous()  # [1, Hq, N, D]
        kv = torch.randn(2, 1, NUM_KV_HEADS, tokens, HEAD_DIM, dtype=DTYPE, device="cuda")
        sdpa_ms = sdpa(q, kv[0], kv[1], causal=True)
    flops = 4 * (tokens * (tokens + 1) // 2) * NUM_Q_HEADS * HEAD_DIM
    chosen = asdict(config) if config else {}
    return Result("prefill", 1, tokens, ms, sdpa_ms, flops, chosen, eager)


def sweep() -> list[Result]:
    """Try launch shapes on the shapes that decide the defaults; print as it goes."""
    results = []
    decode_configs = [LaunchConfig(16, 128, 8, 2)] + [
        LaunchConfig(16, tile_n, 4, stages) for tile_n in (32, 64, 128) for stages in (2, 3)
    ]
    decode_shapes = [(1, 2048), (1, 8192), (16, 2048), (16, 8192), (64, 2048), (64, 8192)]
    for (batch, context), config in itertools.product(decode_shapes, decode_configs):
        for splits in (None, 1, 2, 4, 8, 16):
            if splits is not None and batch * NUM_KV_HEADS * splits > 8192:
                continue
            results.append(
                _try(decode_case, batch, context, config, splits, with_sdpa=False, rep_ms=40)
            )
    prefill_configs = [
        LaunchConfig(block_m, tile_n, warps, stages)
        for block_m, warps in ((64, 4), (128, 4), (128, 8), (256, 8))
        for tile_n, stages in itertools.product((32, 64, 128), (2, 3))
    ]
    for tokens, config in itertools.product(PREFILL_TOKENS, prefill_configs):
        results.append(_try(prefill_case, tokens, config, with_sdpa=False, rep_ms=40))
    return [r for r in results if r is not None]


def sweep_targets(kv_dtype: torch.dtype = DTYPE) -> list[Result]:
    """Launch shapes the full sweep did not try, on the shapes of the open targets only
    (decode 16 x 2k; prefill 2k and 8k): deeper pipelines, 2 and 8 warps. With an FP8
    cache: decode at 16 x 2k and 16 x 8k only (where FP8 gained 1.12x against 1.45x at
    batch 64, ``kernels_fp8_h100.md``), with wider key tiles too (a tile of FP8 keys is
    half the bytes of a bf16 one)."""
    results = []
    fp8 = kv_dtype.itemsize == 1
    shapes = TARGET_DECODE_SHAPES + (FP8_DECODE_SHAPES if fp8 else [])
    contexts = (2048, 8192) if fp8 else (2048,)
    decode_configs = [LaunchConfig(*shape) for shape in shapes]
    for context, config, splits in itertools.product(contexts, decode_configs, (None, 1, 2, 4)):
        results.append(
            _try(decode_case, 16, context, config, splits, with_sdpa=False, rep_ms=40,
                 kv_dtype=kv_dtype)
        )  # fmt: skip
    if not fp8:
        prefill_configs = [LaunchConfig(*shape) for shape in TARGET_PREFILL_SHAPES]
        for tokens, config in itertools.product(PREFILL_TOKENS, prefill_configs):
            results.append(_try(prefill_case, tokens, config, with_sdpa=False, rep_ms=40))
    return [r for r in results if r is not None]


def _try(fn: Callable[..., Result], *args, **kwargs) -> Result | None:
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # a launch shape may not fit the shared memory
        print(f"  {fn.__name__}{args}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None
    print(f"  {result.kind} {result.batch}x{result.tokens} {result.config}: "
          f"{result.triton_ms * 1e3:.1f} us", flush=True)  # fmt: skip
    return result


def host_profile() -> None:
    """Where the host time of an eager decode call (batch 1, 2 splits) goes."""
    import cProfile
    import pstats

    cache, table = paged_cache(1, 512)
    query = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seq_lens = torch.full((1,), 512, dtype=torch.int32, device="cuda")
    eager_ms(lambda: decode_attention(query, cache, seq_lens, table, 0.1, max_seq_len=512))
    with cProfile.Profile() as profile:
        for _ in range(200):
            decode_attention(query, cache, seq_lens, table, 0.1, max_seq_len=512)
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def table(results: list[Result], peak: float) -> str:
    lines = [
        "| case | batch | tokens | triton us | SDPA us | triton | SDPA | SDPA time / triton "
        "time | triton eager us | contiguous read us | read time / triton time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.kind == "decode":
            ours, theirs = r.work / r.triton_ms / 1e9, r.work / r.sdpa_ms / 1e9  # TB/s
            metric = (
                f"{ours:.2f} TB/s ({100 * ours * 1e12 / peak:.0f}%)",
                (f"{theirs:.2f} TB/s ({100 * theirs * 1e12 / peak:.0f}%)"),
            )
        else:
            ours, theirs = r.work / r.triton_ms / 1e9, r.work / r.sdpa_ms / 1e9  # TFLOP/s
            metric = f"{ours:.0f} TFLOP/s", f"{theirs:.0f} TFLOP/s"
        read = "- | -"
        if r.kind == "decode" and r.read_ms == r.read_ms:  # not NaN: measured
            read = f"{r.read_ms * 1e3:.1f} | {r.read_ms / r.triton_ms:.2f}"
        lines.append(
            f"| {r.kind} | {r.batch} | {r.tokens} | {r.triton_ms * 1e3:.1f} | "
            f"{r.sdpa_ms * 1e3:.1f} | {metric[0]} | {metric[1]} | {r.sdpa_ms / r.triton_ms:.2f} | "
            f"{r.triton_eager_ms * 1e3:.1f} | {read} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="try launch shapes (no table)")
    parser.add_argument(
        "--sweep-targets", action="store_true",
        help="try more launch shapes on the open targets' shapes only (no table)",
    )  # fmt: skip
    parser.add_argument("--host-profile", action="store_true", help="profile eager launches")
    parser.add_argument("--json", type=Path, help="write all figures here")
    parser.add_argument("--md", type=Path, help="write the table here")
    parser.add_argument(
        "--kv-cache-dtype", choices=sorted(KV_DTYPES), default="auto",
        help="what the paged cache holds (auto: bf16, like the queries)",
    )  # fmt: skip
    args = parser.parse_args()
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BYTES_PER_S.items() if k in name), 3.35e12)
    header = (
        f"device: {name}; assumed peak HBM bandwidth {peak / 1e12:.2f} TB/s; "
        f"torch {torch.__version__}, triton {triton.__version__}; KV cache {kv_dtype}; "
        f"{datetime.date.today().isoformat()}"
    )
    floor = floor_ms()
    header += f"; an empty graph replay (one tiny kernel) times {floor * 1e3:.1f} us"
    print(header, flush=True)
    if args.host_profile:
        host_profile()
        return
    sweeping = args.sweep or args.sweep_targets
    if sweeping:
        results = sweep() if args.sweep else sweep_targets(kv_dtype)
    else:
        results = []
        for batch, context in DECODE_SHAPES:
            results.append(decode_case(batch, context, kv_dtype=kv_dtype))
            print(table(results[-1:], peak).splitlines()[-1], flush=True)  # progress
        for tokens in PREFILL_TOKENS:
            results.append(prefill_case(tokens, kv_dtype=kv_dtype))
            print(table(results[-1:], peak).splitlines()[-1], flush=True)
        text = table(results, peak)
        print(text)
        if args.md:
            args.md.write_text(f"{header}\n\n{text}\n")
    if args.json:
        payload = {
            "device": name,
            "peak_bytes_per_s": peak,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.date.today().isoformat(),
            "empty_graph_ms": floor,
            "shape": {
                "q_heads": NUM_Q_HEADS,
                "kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "block_size": BLOCK_SIZE,
                "dtype": str(DTYPE),
                "kv_cache_dtype": str(kv_dtype),
            },
            "sweep" if sweeping else "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
