"""The router's own cost per streamed token: a real router process (uvicorn, the OpenAI
API, the dispatcher, gRPC to its worker, detokenizing, SSE) in front of a decode worker
that costs nothing, so the router is the only thing that can be slow.

    python -m benchmarks.router_stream [--streams 128] [--tokens 256] [--rounds 3]
                                       [--step-ms 4 20 0] [--before REV]

The decode worker is a real gRPC server speaking ``DecodeService``, started by this
script in a process of its own (``serve_decode``). It runs "engine steps" of
``--step-ms``: each step makes one token for every running stream, and a stream's writer
sends what it got since its last write as one message, as ``AsyncEngine`` merges the
outputs its reader has not taken. Step 0: one token per message, as fast as the router
reads. A GPU decode worker at a large batch makes tokens faster than one router process
streams them out (4 ms steps x 128 streams = 32,000 tokens/s); there the router's cost
per token and what it does when it falls behind decide the throughput. The router is
``pdserve router`` with a static worker list (the demo model's tokenizer). The client
(this process) opens ``--streams`` streamed chat completions at once, each of
``--tokens`` tokens, reads them all, and counts the tokens from each usage chunk.

Reported per step time, medians over the rounds: the router's CPU time (user + system,
from ``/proc``) per token received, the tokens a second the client got, the SSE chunks
per token (below 1 when chunks carry several tokens), and how long the median and the
slowest stream took. The router's CPU per token holds on any machine; on this 2-core one
the three processes share the cores, so rates compare only side by side. With
``--before REV`` the same cases run on a worktree of REV (its router, this script's
worker and client), one revision after the other, ``--repeats`` times alternating; with
``--before-plain`` too, REV's router cannot import uvloop or httptools, as REV was
installed before they were dependencies (uvicorn then runs asyncio and h11). Records
JSON and Markdown under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder is first on sys.path and its kernels.py would shadow the
# kernels package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from benchmarks import revisions  # noqa: E402

NAME = "router_stream"


def serve_decode(port: int, step_ms: float) -> None:
    """The costless decode worker (``--serve-decode PORT``). Every ``step_ms`` an
    "engine step" gives each running stream one token; a stream's writer sends what its
    stream got since its last write as one message, as ``AsyncEngine`` merges the outputs
    a reader has not taken yet, so a write that waits (the router fell behind) makes the
    next message carry more tokens. ``step_ms`` 0: each stream writes one token per
    message as fast as the router takes them (nothing to merge). Token ids cycle through
    a range every tokenizer maps to text; the last reply carries usage, as a worker's."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as pb_grpc

    class Stream:
        def __init__(self, num_tokens: int) -> None:
            self.num_left = num_tokens  # not made yet
            self.token_ids: list[int] = []  # made, not sent yet
            self.made = asyncio.Event()

    running: set[Stream] = set()

    class Decode(pb_grpc.DecodeServiceServicer):
        async def Generate(self, request, context):
            num_tokens = request.sampling.max_tokens
            usage = pb.Usage(prompt_tokens=len(request.prompt_token_ids),
                             completion_tokens=num_tokens)  # fmt: skip
            if not step_ms:
                for index in range(num_tokens - 1):
                    yield pb.GenerateResponse(token_ids=[100 + index % 400])
                yield pb.GenerateResponse(token_ids=[100], finish_reason="length", usage=usage)
                return
            stream = Stream(num_tokens)
            running.add(stream)
            try:
                num_sent = 0
                while num_sent < num_tokens:
                    await stream.made.wait()
                    stream.made.clear()
                    token_ids, stream.token_ids = stream.token_ids, []
                    num_sent += len(token_ids)
                    if num_sent < num_tokens:
                        yield pb.GenerateResponse(token_ids=token_ids)
                yield pb.GenerateResponse(token_ids=token_ids, finish_reason="length",
                                          usage=usage)  # fmt: skip
            finally:
                running.discard(stream)

        async def Stats(self, request, context):
            return pb.StatsResponse(role="decode", engine_id="costless", kv_blocks_total=1 << 20,
                                    kv_blocks_free=1 << 20)  # fmt: skip

        async def Abort(self, request, context):
            return pb.AbortResponse()

    async def steps() -> None:
        """One token per running stream every ``step_ms``, on a fixed schedule."""
        due = time.monotonic()
        while True:
            due += step_ms / 1e3
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            for stream in running:
                if stream.num_left:
                    stream.token_ids.append(100 + stream.num_left % 400)
                    stream.num_left -= 1
                    stream.made.set()

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(Decode(), server)
        checks = health.aio.HealthServicer()
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stepping = asyncio.create_task(steps()) if step_ms else None
        print("ready", flush=True)
        try:
            await server.wait_for_termination()
        finally:
            if stepping is not None:
                stepping.cancel()

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(client, url: str, model: str, num_tokens: int) -> tuple[int, int, float]:
    """(tokens, SSE chunks with tokens, seconds) of one streamed chat completion."""
    body = {
        "model": model, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": num_tokens, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }  # fmt: skip
    tail = b""
    num_chunks = 0
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for data in response.aiter_bytes():
            num_chunks += data.count(b"data: ")
            tail = (tail + data)[-4096:]
    seconds = time.perf_counter() - start
    events = [line[6:] for line in tail.split(b"\n") if line.startswith(b"data: {")]
    usage = json.loads(events[-1])["usage"]
    # Less the opening chunk (the role: router/formatting.py ``opening``), usage, [DONE].
    return usage["completion_tokens"], num_chunks - 3, seconds


async def load(base_url: str, num_streams: int, num_tokens: int, pids: list[int]) -> dict:
    """``num_streams`` streams at once: their tokens, chunks, wall time and durations, and
    the CPU seconds each of ``pids`` spent on them (the model lookup and a warm-up stream,
    which opens the connections, come before)."""
    import httpx

    limits = httpx.Limits(max_connections=num_streams + 4)
    url = f"{base_url}/v1/chat/completions"
    async with httpx.AsyncClient(limits=limits, timeout=300.0) as client:
        model = (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        await one_stream(client, url, model, 8)
        cpu_s = [cpu_seconds(pid) for pid in pids]
        start = time.perf_counter()
        done = await asyncio.gather(
            *(one_stream(client, url, model, num_tokens) for _ in range(num_streams))
        )
        wall_s = time.perf_counter() - start
        cpu_s = [cpu_seconds(pid) - before for pid, before in zip(pids, cpu_s, strict=True)]
    return {"tokens": sum(d[0] for d in done), "chunks": sum(d[1] for d in done),
            "wall_s": wall_s, "durations_s": sorted(d[2] for d in done),
            "cpu_s": cpu_s}  # fmt: skip


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until the router's /health is 200, which it is once it has seen a worker up."""
    from deploy.health_cmd import check_http

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}")
        if check_http(url, 1.0)[0]:
            return
        time.sleep(0.2)
    raise RuntimeError("the router did not come up")


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_step(args: argparse.Namespace, step_ms: float, sections: dict | None = None) -> list[dict]:
    """``--rounds`` rounds against a router and a costless worker stepping every
    ``step_ms`` (both started here, stopped after). ``sections``: more of the router's
    config (``benchmarks/tracing.py`` adds its ``tracing``)."""
    import yaml

    from benchmarks.loadgen.pinned_stack import free_port_base
    from engine.models.maker import ensure_model

    base = free_port_base(20)
    router_port, decode_port = base, base + 10
    config = {
        "model": str(ensure_model()),
        "prefill": {"replicas": 0},
        "decode": {"replicas": 1, "port": decode_port},
        "router": {"port": router_port, "max_inflight_sequences": 4096},
        **(sections or {}),
    }  # fmt: skip
    rows = []
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-router-stream-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        paths = [os.getcwd()]
        if args.before_plain and args.rows_only:  # the earlier revision, as pip gave it
            for name in PLAIN_BLOCKED:
                (Path(tmp) / f"{name}.py").write_text(f"raise ImportError('{name}: blocked')\n")
            paths.insert(0, tmp)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        try:
            worker = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve-decode",
                 str(decode_port), "--step-ms", str(step_ms)],
                stdout=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            processes.append(worker)
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the costless decode worker exited with {worker.wait()}")
            router = subprocess.Popen(
                [sys.executable, "-m", "deploy.cli", "router", "--config", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            )  # fmt: skip
            processes.append(router)
            wait_ready(f"http://127.0.0.1:{router_port}/health", router)
            for round_index in range(args.rounds):
                got = asyncio.run(load(f"http://127.0.0.1:{router_port}", args.streams,
                                       args.tokens, [router.pid, worker.pid]))  # fmt: skip
                router_cpu, worker_cpu = got["cpu_s"]
                num_tokens = got["tokens"]
                if num_tokens != args.streams * args.tokens:
                    raise RuntimeError(f"got {num_tokens} tokens, expected "
                                       f"{args.streams * args.tokens}")  # fmt: skip
                durations = got["durations_s"]
                row = {
                    "step_ms": step_ms, "round": round_index, "tokens": num_tokens,
                    "wall_s": got["wall_s"], "tokens_per_s": num_tokens / got["wall_s"],
                    "router_cpu_us_per_token": 1e6 * router_cpu / num_tokens,
                    "worker_cpu_us_per_token": 1e6 * worker_cpu / num_tokens,
                    "chunks_per_token": got["chunks"] / num_tokens,
                    "stream_p50_s": durations[len(durations) // 2],
                    "stream_max_s": durations[-1],
                }  # fmt: skip
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
        finally:
            stop(processes)
    return rows


# What ``--before-plain`` keeps the earlier revision's router from importing: uvicorn's
# "auto" then serves with asyncio and h11, as it did before pdserve required them.
PLAIN_BLOCKED = ("uvloop", "httptools")


def run_cases(args: argparse.Namespace) -> list[dict]:
    return [row for step_ms in args.step_ms for row in run_step(args, step_ms)]


KEYS = ("router_cpu_us_per_token", "tokens_per_s", "chunks_per_token", "stream_p50_s",
        "stream_max_s", "worker_cpu_us_per_token")  # fmt: skip


def summary(rows: list[dict], step_ms: float) -> dict:
    """Medians over one step's rounds."""
    rows = [row for row in rows if row["step_ms"] == step_ms]
    return {key: statistics.median(row[key] for row in rows) for key in KEYS}


def case_name(step_ms: float, streams: int) -> str:
    if not step_ms:
        return "free-running (a token per message, as fast as read)"
    return f"a step every {step_ms:g} ms ({streams * 1000 / step_ms:,.0f} tokens/s made)"


def markdown(record: dict) -> str:
    streams, tokens = record["streams"], record["tokens"]
    lines = [
        f"# The router's cost per streamed token ({NAME})", "",
        revisions.command_line(record, NAME), "",
        f"{streams} streamed chat completions at once, {tokens} tokens each, through a "
        "real router (`pdserve router`) in front of a decode worker that costs nothing. "
        "Medians over the rounds (of every repeat). A stream's ideal time is its tokens "
        "times the step.", "",
        "| worker | run | router CPU us / token | tokens/s (client) | SSE chunks / token "
        "| stream p50 s | slowest stream s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    ratios = []
    before = record["before"]
    if record.get("before_plain"):
        before += " (asyncio + h11)"
    for step_ms in record["step_ms"]:
        now = summary(record["rounds"], step_ms)
        runs = [("now", now)]
        if record.get("before_rounds"):
            then = summary(record["before_rounds"], step_ms)
            runs.insert(0, (before, then))
            ratios.append(
                f"- {case_name(step_ms, streams)}: router CPU per token "
                f"{now['router_cpu_us_per_token'] / then['router_cpu_us_per_token']:.2f}x, "
                f"tokens/s {now['tokens_per_s'] / then['tokens_per_s']:.2f}x, slowest stream "
                f"{now['stream_max_s'] / then['stream_max_s']:.2f}x the time."
            )
        for run, values in runs:
            lines.append(
                f"| {case_name(step_ms, streams)} | {run} | "
                f"{values['router_cpu_us_per_token']:.1f} | {values['tokens_per_s']:,.0f} | "
                f"{values['chunks_per_token']:.2f} | {values['stream_p50_s']:.2f} | "
                f"{values['stream_max_s']:.2f} |"
            )
    if ratios:
        lines += ["", f"Now as a multiple of {before}:", *ratios]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[4.0, 20.0, 0.0],
                        help="the worker's step times (0: free-running)")  # fmt: skip
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --before: now, before, now, ... this many times each",
    )
    parser.add_argument("--before-plain", action="store_true",
                        help="run --before's router without uvloop and httptools, as "
                             "installed before they were dependencies")  # fmt: skip
    parser.add_argument("--serve-decode", type=int, default=None, help=argparse.SUPPRESS)
    revisions.add_args(parser)
    args = parser.parse_args(argv)
    if args.serve_decode is not None:
        serve_decode(args.serve_decode, args.step_ms[0])
        return 0
    rows: list[dict] = []
    before_rows: list[dict] | None = None
    for repeat in range(args.repeats):  # alternating, so a drift of the machine hits both
        both = revisions.side_by_side(args, argv, Path(__file__), run_cases)
        if both is None:
            return 0
        rows += [{**row, "repeat": repeat} for row in both[0]]
        if both[1] is not None:
            before_rows = (before_rows or []) + [{**row, "repeat": repeat} for row in both[1]]
    fields = {"streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
              "before_plain": args.before_plain, "rounds": rows,
              "before_rounds": before_rows}  # fmt: skip
    revisions.write_record(args, NAME, argv, fields, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
