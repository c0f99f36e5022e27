"""The torch backend's batched decode attention (``kernels.reference.decode_attention``, the
engine's default on CPU) against its earlier K/V gather, side by side in one process.

    python -m benchmarks.torch_decode_attention [--batch 16 64] [--context 512 2048]

The padded path gathers every sequence's K and V blocks into ``[B, Hkv, nb * bs, D]``
before one SDPA call. Before: ``kv[:, 0][table]`` (the K view indexed by the 2-D block
table), a fresh tensor each layer and step; now: one ``index_select`` of the view by the
flattened table, into buffers kept across calls (``GatherWorkspace``, as the backend keeps
one); "index_select, fresh" is the new gather without the kept buffers. All give the same
tensors (checked); what is timed is the gather alone and the whole call (gather, mask,
SDPA), best of ``--repeats`` rounds, alternating old and new within each round, on shapes
of the demo model (2 KV heads of 64) and of Llama-3-8B's attention (8 of 128), block size
16, float32, one thread, the blocks in a random order. Then the engine: the demo model
decoding ``--engine-prompts`` prompts of ``--engine-prompt-len`` random tokens, its mean
decode step (a 65-token run less a 1-token one, over 64 steps) with the gather as before
and as now, the same tokens checked. Records JSON and Markdown under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.records import machine, write_record
from kernels import reference
from kernels.reference import GatherWorkspace, _padded_kv, decode_attention

RESULTS = Path(__file__).parent / "results"
SHAPES = {"demo (4 q / 2 kv heads of 64)": (4, 2, 64), "llama-8b (32 / 8 of 128)": (32, 8, 128)}
BLOCK_SIZE = 16


def padded_kv_before(
    kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather as it was (kept here as the baseline)."""
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    max_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_table[:, :max_blocks].long()
    key = kv_cache[:, 0][table].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    value = kv_cache[:, 1][table].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    return key, value


@contextlib.contextmanager
def gathering_as_before() -> Iterator[None]:
    """``reference.decode_attention`` (and the engine's torch backend through it) gathers
    with the baseline meanwhile: it reads the module's ``_padded_kv``."""
    kept = reference._padded_kv
    reference._padded_kv = lambda kv_cache, seq_lens, block_table, workspace=None: padded_kv_before(
        kv_cache, seq_lens, block_table
    )
    try:
        yield
    finally:
        reference._padded_kv = kept


def best_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def case(shape: str, batch: int, context: int, repeats: int) -> dict:
    num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    num_blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * num_blocks_per_seq + 8
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(num_blocks, 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator)[: batch * num_blocks_per_seq]
    block_table = order.view(batch, num_blocks_per_seq).int()
    # Contexts spread over the last block's tokens, the longest exactly ``context``.
    seq_lens = context - torch.arange(batch, dtype=torch.int32) % BLOCK_SIZE
    query = torch.randn(batch, num_q_heads, head_dim, generator=generator)
    workspace = GatherWorkspace()

    def kept(*args):
        return _padded_kv(*args, workspace)

    def call_before() -> torch.Tensor:
        with gathering_as_before():
            return decode_attention(query, *args, scale)

    def call_after() -> torch.Tensor:
        return decode_attention(query, *args, scale, workspace=workspace)

    args, scale = (kv_cache, seq_lens, block_table), head_dim**-0.5
    before = padded_kv_before(*args)
    for gather in (_padded_kv, kept):
        after = gather(*args)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(call_before(), call_after())
    calls = max(3, int(2e8 // (batch * context * num_kv_heads * head_dim * 8)))
    timings: dict[str, list[float]] = {k: [] for k in ("gather_before", "gather_fresh",
                                                       "gather_after", "call_before",
                                                       "call_after")}  # fmt: skip
    for _ in range(repeats):
        timings["gather_before"].append(best_ms(lambda: padded_kv_before(*args), calls))
        timings["gather_fresh"].append(best_ms(lambda: _padded_kv(*args), calls))
        timings["gather_after"].append(best_ms(lambda: kept(*args), calls))
        timings["call_before"].append(best_ms(call_before, calls))
        timings["call_after"].append(best_ms(call_after, calls))
    best = {key: min(values) for key, values in timings.items()}
    return {
        "shape": shape, "batch": batch, "context": context,
        **{f"{key}_ms": value for key, value in best.items()},
        "gather_speedup": best["gather_before"] / best["gather_after"],
        "call_speedup": best["call_before"] / best["call_after"],
    }  # fmt: skip


def engine_case(num_prompts: int, prompt_len: int, repeats: int) -> dict:
    """The demo model's mean decode step with the gather as before and as now,
    alternating, best of ``repeats``."""
    from engine import LLM, SamplingParams

    rng = random.Random(0)
    with LLM(dtype="float32", enable_prefix_caching=False, max_num_seqs=num_prompts) as llm:
        vocab = llm.engine.runner.model.arch.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)]
                   for _ in range(num_prompts)]  # fmt: skip

        def step_ms(gathering: contextlib.AbstractContextManager) -> tuple[float, list]:
            first = SamplingParams(max_tokens=1, min_tokens=1, temperature=0)
            whole = SamplingParams(max_tokens=65, min_tokens=65, temperature=0)
            with gathering:
                start = time.perf_counter()
                llm.generate(prompts, first, use_tqdm=False)
                middle = time.perf_counter()
                outputs = llm.generate(prompts, whole, use_tqdm=False)
                end = time.perf_counter()
            return ((end - middle) - (middle - start)) / 64 * 1e3, [
                o.outputs[0].token_ids for o in outputs
            ]

        runs: dict[str, list[float]] = {"before": [], "after": []}
        tokens = {}
        for _ in range(repeats):
            for name, gathering in (("before", gathering_as_before()),
                                    ("after", contextlib.nullcontext())):  # fmt: skip
                ms, tokens[name] = step_ms(gathering)
                runs[name].append(ms)
    step = {name: min(values) for name, values in runs.items()}
    return {
        "num_prompts": num_prompts, "prompt_len": prompt_len,
        "step_before_ms": step["before"], "step_after_ms": step["after"],
        "step_speedup": step["before"] / step["after"],
        "same_tokens": tokens["before"] == tokens["after"],
    }  # fmt: skip


def markdown(rows: list[dict], header: str, args: argparse.Namespace, engine: dict) -> str:
    lines = [
        "# Torch backend decode attention: the K/V gather before and after",
        "",
        f"`python -m benchmarks.torch_decode_attention --batch {' '.join(map(str, args.batch))}"
        f" --context {' '.join(map(str, args.context))} --repeats {args.repeats}`",
        "",
        f"{header}, torch {torch.__version__}; "
        "float32, block size 16, blocks in random order; best of the rounds, old and new "
        "alternating; outputs equal (checked).",
        "",
        "| shape | batch | context | gather ms before | index_select, fresh | after (kept "
        "buffers) | speedup | whole call ms before | after | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['gather_before_ms']:.2f} | "
            f"{r['gather_fresh_ms']:.2f} | {r['gather_after_ms']:.2f} | "
            f"{r['gather_speedup']:.2f}x | "
            f"{r['call_before_ms']:.2f} | {r['call_after_ms']:.2f} | {r['call_speedup']:.2f}x |"
        )
    lines += [
        "",
        f"The engine (demo model, {engine['num_prompts']} prompts of {engine['prompt_len']} "
        f"tokens, 64 decode steps): mean decode step {engine['step_before_ms']:.1f} ms before, "
        f"{engine['step_after_ms']:.1f} ms after, **{engine['step_speedup']:.2f}x**; same "
        f"tokens: {engine['same_tokens']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-prompts", type=int, default=48)
    parser.add_argument("--engine-prompt-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "torch_decode_attention_cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for shape in args.shapes:
        for batch in args.batch:
            for context in args.context:
                rows.append(case(shape, batch, context, args.repeats))
                r = rows[-1]
                print(f"{shape}, batch {batch}, context {context}: gather "
                      f"{r['gather_speedup']:.2f}x, whole call {r['call_speedup']:.2f}x",
                      flush=True)  # fmt: skip
    engine = engine_case(args.engine_prompts, args.engine_prompt_len, max(2, args.repeats - 1))
    print(f"engine: decode step {engine['step_speedup']:.2f}x", flush=True)
    header = machine()
    record = {"benchmark": "torch_decode_attention", "machine": header, "rows": rows,
              "engine": engine}  # fmt: skip
    text = markdown(rows, header, args, engine)
    write_record(args.out, record, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
