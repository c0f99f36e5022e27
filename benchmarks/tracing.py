"""What tracing costs the router: its CPU per request with ``tracing`` off and on, side by
side, through ``benchmarks/router_stream.py``'s real router in front of a decode worker
that costs nothing (so the router is all that is measured).

    python -m benchmarks.tracing [--streams 128] [--tokens 16] [--rounds 3]
                                 [--step-ms 4 0] [--repeats 2]

Short streams (``--tokens``), because a span is a per-request cost: at 16 tokens a
request's own work is small and a span's share of it is as large as it gets. On, the
router exports every span (``sample_ratio`` 1) to an OTLP/HTTP sink in this process,
which answers as a collector does and counts what it got; the decode worker is the
costless one, so only the router's spans are made (a worker's span is the same one span
per call, next to a model's step). Off and on alternate ``--repeats`` times, so a drift
of the shared machine hits both. Records JSON and Markdown under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Run as a script, this folder is first on sys.path and its kernels.py would shadow the
# kernels package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks import revisions  # noqa: E402
from benchmarks.router_stream import run_step  # noqa: E402

NAME = "tracing"


class Sink:
    """An OTLP/HTTP endpoint that answers 200 and counts the exports and bytes it got."""

    def __init__(self) -> None:
        self.num_exports = 0
        self.num_bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.num_bytes += len(self.rfile.read(int(self.headers["content-length"])))
                sink.num_exports += 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def run(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every (repeat, step, tracing) case's rounds, and what the sink received."""
    sink = Sink()
    rows = []
    try:
        for repeat in range(args.repeats):
            for step_ms in args.step_ms:
                for traced in (False, True):
                    sections = {"tracing": {"otlp_traces_endpoint": sink.url}} if traced else {}
                    print(f"repeat {repeat}, step {step_ms:g} ms, tracing "
                          f"{'on' if traced else 'off'}", file=sys.stderr)  # fmt: skip
                    for row in run_step(args, step_ms, sections):
                        rows.append({**row, "repeat": repeat, "tracing": traced})
    finally:
        sink.close()
    return rows, {"exports": sink.num_exports, "bytes": sink.num_bytes}


def cpu_us_per_request(rows: list[dict], step_ms: float, traced: bool, streams: int) -> float:
    """The router's CPU per request, median over the rounds."""
    chosen = [r for r in rows if r["step_ms"] == step_ms and r["tracing"] == traced]
    return statistics.median(r["router_cpu_us_per_token"] * r["tokens"] / streams
                             for r in chosen)  # fmt: skip


def markdown(record: dict) -> str:
    streams, tokens, rows = record["streams"], record["tokens"], record["rounds"]
    lines = [
        f"# What tracing costs the router ({NAME})", "",
        revisions.command_line(record, NAME), "",
        f"{streams} streamed chat completions at once, {tokens} tokens each, through a real "
        "router in front of a decode worker that costs nothing; tracing off and on "
        f"alternating {record['repeats']} times, every span exported (sample ratio 1) to an "
        f"OTLP/HTTP sink, which got {record['sink']['exports']} exports "
        f"({record['sink']['bytes']:,} bytes). Medians over the rounds.", "",
        "| worker step | router CPU us / request, off | on | on / off | tokens/s off | on |",
        "|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for step_ms in record["step_ms"]:
        off = cpu_us_per_request(rows, step_ms, False, streams)
        on = cpu_us_per_request(rows, step_ms, True, streams)
        rates = [statistics.median(r["tokens_per_s"] for r in rows
                                   if r["step_ms"] == step_ms and r["tracing"] == traced)
                 for traced in (False, True)]  # fmt: skip
        step = f"{step_ms:g} ms" if step_ms else "free-running"
        lines.append(f"| {step} | {off:,.0f} | {on:,.0f} | {on / off:.2f}x | "
                     f"{rates[0]:,.0f} | {rates[1]:,.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[4.0, 0.0])
    parser.add_argument("--repeats", type=int, default=2)
    revisions.add_record_args(parser)
    args = parser.parse_args(argv)
    args.before_plain = args.rows_only = False  # what run_step reads of router_stream's
    rows, sink = run(args)
    fields = {"streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
              "repeats": args.repeats, "rounds": rows, "sink": sink}  # fmt: skip
    revisions.write_record(args, NAME, argv, fields, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
