"""A soak of a running stack: a mixed load the router must remember nothing of, sampled
for growth (memory, fds, threads, metric series, KV blocks, leases, registry keys).

    pdserve up --config deploy/configs/redis-registry.yaml --set router.port=27000 ...
    python -m benchmarks.soak --up-pid PID --router http://127.0.0.1:27000 \
        --prefill 127.0.0.1:27100 --decode 127.0.0.1:27200 --redis-port 27379 \
        --concurrency 6 --load-s 600 --idle-s 150 --out soak.jsonl

The load (``--concurrency`` clients for ``--load-s``): completions and chats, streamed and
not, n up to 3, unique prompt prefixes and one shared 420-word system prompt, cache_salt,
logprobs, clients that leave mid-stream or time out before the reply, invalid bodies (400,
404), embeddings, /tokenize and /v1/responses. Every ``--interval-s`` (through the load and
``--idle-s`` after it), one JSON line: per process of ``pdserve up`` (its children found by
their role) RSS, fds, threads and TCP connections; the router's /metrics series and its
running / waiting sequences; each worker's Stats (KV blocks used, leases, running, waiting,
quarantined); the registry's Redis keys. At idle the blocks, leases and in-flight counts
must be back at zero and fds / threads at their start; RSS may plateau (a worker's KV pages
are touched as the cache fills), not grow with the requests served.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import httpx
import psutil

from common.prometheus_text import sample_totals
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
)
SHARED_PREFIX = " ".join(random.Random(7).choice(WORDS) for _ in range(420))
MODEL = "<model>"  # stands for the served model in the bodies below
INVALID_BODIES = (
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}),
    ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**7}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "a", "schema": {"type": "bogus"}}}}),
)  # fmt: skip


@dataclass(frozen=True)
class SoakConfig:
    up_pid: int
    router: str
    prefill: str  # a prefill worker's gRPC address
    decode: str
    redis_port: int | None
    concurrency: int
    load_s: float
    idle_s: float
    interval_s: float
    out: str
    seed: int
    model: str  # the served model's name


class Mix:
    """One request of the mix per call; returns its outcome's name (counted)."""

    def __init__(self, seed: int, model: str) -> None:
        self.rng = random.Random(seed)
        self.model = model
        self.kinds: list[Callable[[httpx.AsyncClient], Awaitable[str]]] = [
            *[self.completion] * 6, *[self.shared_chat] * 4, *[self.leave_stream] * 2,
            self.leave_before_reply, *[self.invalid] * 2, self.garbage, self.embed,
            self.tokenize, self.responses,
        ]  # fmt: skip

    def text(self, num_words: int) -> str:
        """A prompt with a unique head (its prefix is cached nowhere yet)."""
        words = " ".join(self.rng.choice(WORDS) for _ in range(num_words))
        return f"{self.rng.getrandbits(64):x} {words}"

    async def send(self, client: httpx.AsyncClient, path: str, body: dict) -> str:
        name = path.removeprefix("/v1/")
        if not body.get("stream"):
            return f"{name}:{(await client.post(path, json=body)).status_code}"
        async with client.stream("POST", path, json=body) as reply:
            async for _ in reply.aiter_lines():
                pass
            return f"{name}-stream:{reply.status_code}"

    async def completion(self, client: httpx.AsyncClient) -> str:
        body = {"model": self.model, "prompt": self.text(self.rng.choice([20, 80, 300, 600])),
                "max_tokens": self.rng.randint(4, 24), "stream": self.rng.random() < 0.5,
                "n": self.rng.choice([1, 1, 2, 3]), "temperature": 0.8}  # fmt: skip
        return await self.send(client, "/v1/completions", body)

    async def shared_chat(self, client: httpx.AsyncClient) -> str:
        messages = [{"role": "system", "content": SHARED_PREFIX},
                    {"role": "user", "content": self.text(10)}]  # fmt: skip
        body = {"model": self.model, "messages": messages, "max_tokens": self.rng.randint(4, 24),
                "stream": self.rng.random() < 0.5}  # fmt: skip
        if self.rng.random() < 0.5:
            body["cache_salt"] = f"salt-{self.rng.getrandbits(32):x}"
        if self.rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": 2}
        return await self.send(client, "/v1/chat/completions", body)

    async def leave_stream(self, client: httpx.AsyncClient) -> str:
        """A streaming client that reads a few chunks and goes."""
        body = {"model": self.model, "prompt": self.text(self.rng.choice([30, 400])),
                "max_tokens": 64, "stream": True, "n": self.rng.choice([1, 2]),
                "ignore_eos": True}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            chunks, leave_after = 0, self.rng.randint(1, 4)
            async for _ in reply.aiter_lines():
                chunks += 1
                if chunks >= leave_after:
                    break
        return "left-stream"

    async def leave_before_reply(self, client: httpx.AsyncClient) -> str:
        body = {"model": self.model, "prompt": self.text(300), "max_tokens": 64, "ignore_eos": True}
        try:
            await client.post("/v1/completions", json=body, timeout=0.3)
            return "replied-before-leaving"
        except httpx.TimeoutException:
            return "left-before-reply"

    async def invalid(self, client: httpx.AsyncClient) -> str:
        path, body = self.rng.choice(INVALID_BODIES)
        body = {k: self.model if v == MODEL else v for k, v in body.items()}
        return f"invalid:{(await client.post(path, json=body)).status_code}"

    async def garbage(self, client: httpx.AsyncClient) -> str:
        headers = {"content-type": "application/json"}
        reply = await client.post("/v1/completions", content=b"{not json", headers=headers)
        return f"garbage:{reply.status_code}"

    async def embed(self, client: httpx.AsyncClient) -> str:
        inputs = [self.text(self.rng.choice([10, 50])) for _ in range(self.rng.randint(1, 3))]
        reply = await client.post("/v1/embeddings", json={"model": self.model, "input": inputs})
        return f"embeddings:{reply.status_code}"

    async def tokenize(self, client: httpx.AsyncClient) -> str:
        reply = await client.post("/tokenize", json={"model": self.model, "prompt": self.text(30)})
        return f"tokenize:{reply.status_code}"

    async def responses(self, client: httpx.AsyncClient) -> str:
        body = {"model": self.model, "input": self.text(20), "max_output_tokens": 8}
        return f"responses:{(await client.post('/v1/responses', json=body)).status_code}"


async def run_load(config: SoakConfig) -> dict[str, int]:
    """``config.concurrency`` clients sending the mix until ``config.load_s`` has passed."""
    mix, outcomes = Mix(config.seed, config.model), collections.Counter()
    end = time.monotonic() + config.load_s
    limits = httpx.Limits(max_connections=config.concurrency + 2)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            try:
                outcomes[await mix.rng.choice(mix.kinds)(client)] += 1
            except Exception as exc:  # counted: a soak reports what failed, and goes on
                outcomes[f"error:{type(exc).__name__}"] += 1

    async with httpx.AsyncClient(base_url=config.router, timeout=120, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(config.concurrency)))
    return dict(sorted(outcomes.items()))


def process_figures(up_pid: int) -> dict[str, dict]:
    """RSS (MiB), fds, threads and TCP connections of ``pdserve up`` and its children."""
    up = psutil.Process(up_pid)
    named = {"up": up}
    for child in up.children():
        role = next((r for r in ("prefill", "decode", "router") if r in child.cmdline()), None)
        if role is not None:
            named[f"{role}-{child.pid}"] = child
    figures = {}
    for name, proc in named.items():
        with proc.oneshot():
            figures[name] = {"rss_mib": round(proc.memory_info().rss / 2**20, 1),
                             "fds": proc.num_fds(), "threads": proc.num_threads(),
                             "tcp": len(proc.net_connections(kind="tcp"))}  # fmt: skip
    return figures


def worker_stats(address: str, stub_type: type) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        reply = stub_type(channel).Stats(pb.StatsRequest(), timeout=5)
    return {"kv_blocks_used": reply.kv_blocks_used, "live_leases": reply.live_leases,
            "running": reply.num_running, "waiting": reply.num_waiting,
            "quarantined": reply.kv_blocks_quarantined,
            "finished": reply.requests_finished}  # fmt: skip


def router_figures(router: str) -> dict[str, float]:
    """The router's /metrics series (label sets) and its sequences in flight."""
    text = httpx.get(f"{router}/metrics", timeout=10).text
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    in_flight = sample_totals(text, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    return {"series": series, **in_flight}


def redis_keys(port: int | None) -> int | None:
    if port is None:
        return None
    done = subprocess.run(["redis-cli", "-p", str(port), "dbsize"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return int(done.stdout.strip())


def sample(config: SoakConfig, phase: str) -> dict:
    return {"t": round(time.time(), 1), "phase": phase,
            "processes": process_figures(config.up_pid), "router": router_figures(config.router),
            "prefill": worker_stats(config.prefill, pb_grpc.PrefillServiceStub),
            "decode": worker_stats(config.decode, pb_grpc.DecodeServiceStub),
            "redis_keys": redis_keys(config.redis_port)}  # fmt: skip


def sample_until(config: SoakConfig, phase: list[str], stop: threading.Event) -> None:
    """A line to ``config.out`` every ``interval_s`` until ``stop``; ``phase[0]`` labels it."""
    with open(config.out, "a") as out:
        while True:
            out.write(json.dumps(sample(config, phase[0])) + "\n")
            out.flush()
            if stop.wait(config.interval_s):
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--up-pid", type=int, required=True, help="the pdserve up process")
    parser.add_argument("--router", default="http://127.0.0.1:27000")
    parser.add_argument("--prefill", default="127.0.0.1:27100")
    parser.add_argument("--decode", default="127.0.0.1:27200")
    parser.add_argument("--redis-port", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--load-s", type=float, default=600)
    parser.add_argument("--idle-s", type=float, default=150)
    parser.add_argument("--interval-s", type=float, default=30)
    parser.add_argument("--out", default="soak.jsonl")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", default="demo", help="the served model's name")
    config = SoakConfig(**{k: v for k, v in vars(parser.parse_args()).items()})
    phase, stop = ["load"], threading.Event()
    sampler = threading.Thread(target=sample_until, args=(config, phase, stop))
    sampler.start()
    try:
        print(json.dumps(asyncio.run(run_load(config)), indent=1), flush=True)
        phase[0] = "idle"
        time.sleep(config.idle_s)
    finally:
        stop.set()
        sampler.join()


if __name__ == "__main__":
    main()
