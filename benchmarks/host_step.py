"""The engine's host path per decode step, outside the model runner: this code against an
earlier revision, side by side in one script.

    python -m benchmarks.host_step [--batch 256] [--context 8192 32768] [--before REV]

What is timed is ``LLMEngine.step`` with the runner's ``execute`` answered at once by a
fixed token for every sampling chunk: scheduling, the chunks handed to the runner,
advancing the requests and building their outputs. The forward pass, the host batch and
the sampler are left out on purpose; they have their own records (``kernels``,
``host_batch``, ``sampler``). This is the part that grows with the context on the host and
that a GPU waits for between steps.

Each case runs ``batch`` requests whose sequences hold ``context`` tokens when timing
starts, in two shapes:

- *prompt*: a ``context``-token prompt, decoding from its first output token;
- *output*: a prompt of an eighth of the context, the rest already generated (handed in
  as ``output_token_ids``, as a migrated request's tokens are), the shape of a long
  reasoning answer.

Every request has the same tokens, so the prefix cache holds one copy of them and a 32k
context fits in memory at batch 256 (what is timed does not read token values). The
model is the made tiny llama, its context raised in a copy of its config.

``--before REV`` runs the same cases on a ``git worktree`` of REV (this file, that
revision's packages) and prints the ratio. Records JSON and Markdown under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder is first on sys.path and its kernels.py would shadow the
# kernels package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks import revisions  # noqa: E402

TOKEN_ID = 7  # what every step "samples": not EOS, and EOS is ignored anyway
BLOCK_SIZE = 16


def long_context_model(context: int, workdir: Path) -> Path:
    """The made tiny llama with ``max_position_embeddings`` raised to hold ``context``."""
    from engine.models.maker import ensure_model

    source = ensure_model("llama", "tiny")
    target = workdir / f"tiny-{context}"
    if not target.exists():
        shutil.copytree(source, target)
        config_path = target / "config.json"
        config = json.loads(config_path.read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], 2 * context)
        config_path.write_text(json.dumps(config))
    return target


def run_case(batch: int, context: int, shape: str, steps: int, workdir: Path) -> dict:
    from common.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_runner import StepResult
    from engine.sampling_params import SamplingParams

    num_prompt = context if shape == "prompt" else context // 8
    max_model_len = context + steps + BLOCK_SIZE
    # The shared tokens once, and each request's own blocks for the steps timed.
    num_blocks = max_model_len // BLOCK_SIZE + batch * (steps // BLOCK_SIZE + 3)
    config = EngineConfig(
        num_blocks=num_blocks, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
        max_model_len=max_model_len, cuda_graphs=False, device="cpu",
    )  # fmt: skip
    engine = LLMEngine(long_context_model(context, workdir), config)

    def execute(chunks: list) -> StepResult:
        return StepResult(
            sampled={c.request_id: [(TOKEN_ID, None)] for c in chunks if c.sampling is not None}
        )

    engine.runner.execute = execute
    tokens = [5 + i % 1000 for i in range(context)]
    prompt, generated = tokens[:num_prompt], tokens[num_prompt:]
    params = SamplingParams(max_tokens=context + steps + 8, temperature=0.0, ignore_eos=True)
    # The first request computes the shared tokens; the rest then find them cached.
    engine.add_request("r0", prompt, params, output_token_ids=generated)
    while engine.scheduler.requests["r0"].num_computed_tokens < context:
        engine.step()
    for i in range(1, batch):
        engine.add_request(f"r{i}", prompt, params, output_token_ids=generated)
    while len(engine.scheduler.running) < batch or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
    ):
        engine.step()
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - start)
        if len(outputs) != batch:
            raise AssertionError(f"{len(outputs)} outputs from a step of {batch} requests")
    for i in range(batch):
        engine.abort_request(f"r{i}")
    leaks = engine.leak_report()
    if leaks:
        raise AssertionError(f"leaked: {leaks}")
    return {
        "batch": batch, "context": context, "shape": shape, "steps": steps,
        "ms": statistics.median(step_s) * 1e3,
    }  # fmt: skip


def run_cases(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="host-step-") as workdir:
        for batch in args.batch:
            for context in args.context:
                for shape in args.shapes:
                    row = run_case(batch, context, shape, args.steps, Path(workdir))
                    rows.append(row)
                    print(f"  batch {batch:4d} context {context:6d} {shape:6s}: "
                          f"{row['ms']:8.3f} ms a step", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def markdown(record: dict) -> str:
    before = record["before"]
    lines = [
        "# The engine's host path per decode step (outside the model runner)",
        "",
        f"{revisions.command_line(record, 'host_step')}. Median over {record['steps']} "
        "decode steps of "
        "`LLMEngine.step`, the runner answering at once (see the module's docstring). "
        "*prompt*: the context is all prompt; *output*: an eighth of it is, the rest was "
        "generated.",
        "",
        "| batch | context (tokens) | shape | now ms/step |"
        + (f" {before} ms/step | {before} / now |" if before else ""),
        "|---:|---:|---|---:|" + ("---:|---:|" if before else ""),
    ]
    for row in record["rows"]:
        line = f"| {row['batch']} | {row['context']} | {row['shape']} | {row['ms']:.2f} |"
        if before:
            line += f" {row['before_ms']:.2f} | {row['before_ms'] / row['ms']:.1f}x |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--shapes", nargs="+", default=["prompt", "output"],
                        choices=("prompt", "output"))  # fmt: skip
    parser.add_argument("--steps", type=int, default=32)
    revisions.add_args(parser)
    args = parser.parse_args(argv)
    ran = revisions.side_by_side(args, argv, Path(__file__), run_cases)
    if ran is None:  # the --before child
        return 0
    rows, before_rows = ran
    for row, old in zip(rows, before_rows or [], strict=before_rows is not None):
        row["before_ms"] = old["ms"]
        print(f"  batch {row['batch']:4d} context {row['context']:6d} {row['shape']:6s}: "
              f"{old['ms']:8.3f} ms a step, {old['ms'] / row['ms']:5.1f}x now's",
              file=sys.stderr, flush=True)  # fmt: skip
    revisions.write_record(args, "host_step", argv, {"steps": args.steps, "rows": rows},
                           markdown)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
