"""A whole ``pdserve up`` stack as a subprocess, for gateway and end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import yaml

from benchmarks.loadgen.pinned_stack import worker_stats as worker_stats_at
from common.config_loader import load_config
from common.hosts import host_port, local_host
from proto import pdserve_pb2 as pb
from tests.support.processes import ROOT


@dataclass
class UpStack:
    config_path: Path
    proc: subprocess.Popen
    log_path: Path

    @property
    def config(self) -> dict:
        return yaml.safe_load(self.config_path.read_text())

    @property
    def base_url(self) -> str:
        router = self.config["router"]
        return f"http://{host_port(local_host(router.get('host', '127.0.0.1')), router['port'])}"

    def children(self) -> dict[str, int]:
        """Child process name (role-index or router) → pid."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        result = {}
        for pid in map(int, out.stdout.split()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode() for a in argv]
            if "router" in args:
                result["router"] = pid
            for role in ("prefill", "decode"):
                if role in args:
                    result[f"{role}-{args[args.index('--index') + 1]}"] = pid
        return result

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def openai_client(self, api_key: str = "none") -> openai.OpenAI:
        """A client of the router's /v1 that never retries (a test sees every error)."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch_up(
    config_path: Path, home: Path, restart: bool = True, env: dict[str, str] | None = None
) -> UpStack:
    """``pdserve up`` on ``config_path``, not waited for; ``restart=False`` leaves failed
    workers down (tests of how the router copes with a dead worker); ``env``: more of
    the environment (an internal token)."""
    log_path = config_path.with_suffix(".up.log")
    env = {**os.environ, "PDSERVE_HOME": str(home), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "up", "--config", str(config_path),
             *([] if restart else ["--no-restart"])],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )  # fmt: skip
    return UpStack(config_path, proc, log_path)


def start_up_stack(
    config_path: Path,
    home: Path,
    timeout: float = 180.0,
    restart: bool = True,
    env: dict[str, str] | None = None,
) -> UpStack:
    """``launch_up``, then wait until the stack serves."""
    stack = launch_up(config_path, home, restart, env)
    proc, log_path = stack.proc, stack.log_path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited ({proc.returncode}):\n{stack.log()}")
        if "pdserve is up" in log_path.read_text(errors="replace"):
            return stack
        time.sleep(0.3)
    stack.stop()
    raise TimeoutError(f"pdserve up not ready:\n{stack.log()}")


@contextlib.contextmanager
def serving(config_path: Path, home: Path, restart: bool = True) -> Iterator[UpStack]:
    """``start_up_stack``; on leaving, stop it and assert that it exited cleanly."""
    stack = start_up_stack(config_path, home, restart=restart)
    try:
        yield stack
    finally:
        code = stack.stop()
    assert code == 0, stack.log()


def get_json(url: str, key: str | None = None) -> tuple[int, dict]:
    import json

    request = urllib.request.Request(url)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def worker_stats(stack: UpStack, role: str) -> list[pb.StatsResponse]:
    """Stats of every replica of ``role`` (prefill or decode), in replica order; a worker
    that does not answer raises ``grpc.RpcError``."""
    config = load_config(str(stack.config_path))
    section = config.prefill if role == "prefill" else config.decode
    return [
        worker_stats_at(host_port(section.host, section.ports(index).grpc), role)
        for index in range(section.replicas)
    ]


def metric(stack: UpStack, name: str, **labels: str) -> float:
    """The router's metric ``name`` summed over the series with these labels."""
    text = urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
