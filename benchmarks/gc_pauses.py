"""The garbage collector's full passes in a worker-sized process, with and without the
startup heap frozen (``common/gc_heap.py``), side by side in one script.

    python -m benchmarks.gc_pauses [--requests 3000] [--rounds 2]

Each run is a fresh process (a freeze is for the whole process): it imports what a worker
imports (gRPC, both services, the engine), loads the made tiny llama, freezes the heap or
not, then generates ``--requests`` short sampled requests with ``LLM.generate`` while a
``gc.callbacks`` hook times every full (generation 2) pass. A pass holds the GIL, so on
a worker it stalls the engine thread for that long: the max pause is what one step's
latency can gain. Runs alternate (no freeze, freeze) for ``--rounds``. Records JSON and
Markdown under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path and its kernels.py would shadow the
# kernels package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks import revisions  # noqa: E402

CHILD = """
import gc, json, sys, time
import grpc, worker.main, decode_service.servicer, prefill_service.servicer  # a worker's heap
from common.gc_heap import freeze_startup_heap
from engine import LLM, SamplingParams
from engine.models.maker import ensure_model
num_requests, freeze = int(sys.argv[1]), sys.argv[2] == "freeze"
llm = LLM(ensure_model("llama", "tiny"), max_num_seqs=64)
tracked = len(gc.get_objects())
if freeze:
    freeze_startup_heap()
pauses, started = [], [0.0]
def timed(phase, info):
    if info["generation"] == 2:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])
gc.callbacks.append(timed)
prompts = [[5 + (i * 7 + j) % 1500 for j in range(24)] for i in range(num_requests)]
params = SamplingParams(max_tokens=16, temperature=0.8, logprobs=1)
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"wall_s": time.perf_counter() - start, "tracked_at_start": tracked,
                  "full_passes": len(pauses), "total_pause_s": sum(pauses),
                  "max_pause_s": max(pauses, default=0.0)}))
"""


def run_child(num_requests: int, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(num_requests), mode],
        cwd=revisions.ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def markdown(record: dict) -> str:
    lines = [
        "# Full garbage-collector passes, with and without the startup heap frozen",
        "",
        f"{revisions.command_line(record, 'gc_pauses')}. {record['requests']} requests "
        "(24 prompt tokens, 16 sampled tokens with log-probs) through `LLM.generate` on the "
        "made tiny llama, in a process that imported what a worker imports; a fresh "
        "process per run, runs alternating.",
        "",
        "| round | heap | tracked objects at start | full passes | total pause ms "
        "| max pause ms | wall s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['round']} | {row['mode']} | {row['tracked_at_start']} "
            f"| {row['full_passes']} | {row['total_pause_s'] * 1e3:.0f} "
            f"| {row['max_pause_s'] * 1e3:.0f} | {row['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    revisions.add_record_args(parser)
    args = parser.parse_args(argv)
    rows = []
    for round_index in range(args.rounds):
        for mode in ("none", "freeze"):
            row = {"round": round_index, **run_child(args.requests, mode)}
            rows.append(row)
            print(f"  round {round_index} {mode:6s}: {row['full_passes']} full passes, "
                  f"total {row['total_pause_s'] * 1e3:6.0f} ms, max "
                  f"{row['max_pause_s'] * 1e3:5.0f} ms, {row['wall_s']:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    revisions.write_record(args, "gc_pauses", argv, {"requests": args.requests, "rows": rows},
                           markdown)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
