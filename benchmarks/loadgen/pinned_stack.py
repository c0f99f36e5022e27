"""A pdserve stack started piece by piece, each worker pinned to one CPU core with
``taskset`` (``pdserve up`` cannot pin), for benchmarks that compare deployments on equal
cores. The router is not pinned. Ports are free ones; logs go to a temporary directory
that is removed after a clean stop and kept (and named) otherwise.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.config import PORT_STRIDE
from common.internal_auth import InternalAuth
from deploy.health_cmd import check_http
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Placement:
    role: str  # "prefill" or "decode"
    index: int
    core: int


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_start() -> int:
    """Where the kernel's ephemeral (outgoing-connection) ports begin."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_range(span: int) -> tuple[int, int]:
    """[low, high) where ``free_port_base`` looks: 20000 up to the ephemeral range, or with
    ``PDSERVE_PORT_SLICE`` ("INDEX/COUNT") set, slice INDEX of COUNT equal slices of it.
    The test suite gives each of its parallel processes its own slice (tests/conftest.py),
    so two stacks starting at once never pick the same ports between one's check and its
    workers' binds."""
    low, high = 20000, max(_ephemeral_start(), 20000 + 100 * span)
    if (part := os.environ.get("PDSERVE_PORT_SLICE")) is not None:
        index, count = (int(n) for n in part.split("/"))
        width = (high - low) // count // PORT_STRIDE * PORT_STRIDE
        low, high = low + index * width, low + (index + 1) * width
    return low, high


def free_port_base(span: int, rng: random.Random | None = None) -> int:
    """A base port with ``span`` free consecutive ports after it, below the ephemeral
    range: a port found free there can be taken by any outgoing connection (a gRPC
    channel, a UCX endpoint) before the worker binds it, which a CI run hit."""
    rng = rng or random.Random()
    low, high = _port_range(span)
    for _ in range(500):
        base = rng.randrange(low, high - span, PORT_STRIDE)
        if all(port_is_free(base + i) for i in range(span)):
            return base
    raise RuntimeError("no free port range")


def worker_stats(address: str, role: str) -> pb.StatsResponse:
    """The Stats of the ``role`` (prefill or decode) worker at ``address``; raises
    ``grpc.RpcError`` if it does not answer."""
    stub = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
    # (with the deployment's internal token, if this environment has one)
    with InternalAuth.from_env().channel(address) as channel:
        return stub(channel).Stats(pb.StatsRequest(), timeout=5)


class PinnedStack:
    def __init__(self, name: str, model: Path, placements: list[Placement],
                 kv_cache_bytes: int = 256 << 20,
                 overrides: dict[str, dict[str, Any]] | None = None) -> None:  # fmt: skip
        """``overrides``: config keys by section (``{"router": {...}}``) over the defaults
        below."""
        self.name = name
        self.placements = placements
        self.dir = Path(tempfile.mkdtemp(prefix=f"pdserve-{name}-"))
        self.procs: list[tuple[str, subprocess.Popen]] = []
        rng = random.Random()
        replicas = {r: sum(p.role == r for p in placements) for r in ("prefill", "decode")}
        config = {
            "model": str(model),
            "engine": {"kv_cache_bytes": kv_cache_bytes},
            "prefill": {"replicas": replicas["prefill"], "drain_grace_s": 5,
                        "port": free_port_base(PORT_STRIDE * max(1, replicas["prefill"]), rng)},
            "decode": {"replicas": replicas["decode"], "drain_grace_s": 5,
                       "port": free_port_base(PORT_STRIDE * replicas["decode"], rng)},
            "router": {"port": free_port_base(1, rng), "min_disagg_tokens": 0, "drain_grace_s": 5},
        }  # fmt: skip
        for section, values in (overrides or {}).items():
            config.setdefault(section, {}).update(values)
        self.port = config["router"]["port"]
        self._base_ports = {role: config[role]["port"] for role in ("prefill", "decode")}
        self.config_path = self.dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))

    @staticmethod
    def model_dir(model: Path | None) -> Path:
        """``model``, or the built-in demo model (made on first use)."""
        if model is not None:
            return model
        from engine.models.maker import ensure_model

        return ensure_model()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _spawn(self, name: str, args: list[str], core: int | None) -> None:
        command = [sys.executable, "-m", "deploy.cli", "--log-level", "INFO", *args,
                   "--config", str(self.config_path)]  # fmt: skip
        if core is not None:
            command = ["taskset", "-c", str(core), *command]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=REPO_ROOT, env=env)  # fmt: skip
        self.procs.append((name, proc))

    def start(self) -> None:
        """Start the workers (the router starts once they are ready)."""
        for p in self.placements:
            self._spawn(f"{p.role}-{p.index}", [p.role, "--index", str(p.index)], p.core)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name, proc in list(self.procs):
            self._wait(name, proc, deadline, lambda n=name: "ready on" in self._log(n))
        self._spawn("router", ["router"], None)
        self._wait("router", self.procs[-1][1], deadline, self._healthy)
        time.sleep(2.5)  # the router's refresh (1 s) sees every worker healthy

    def _wait(self, name: str, proc: subprocess.Popen, deadline: float, ready) -> None:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}/{name} exited:\n{self._log(name)[-3000:]}")
            if ready():
                return
            time.sleep(0.3)
        raise TimeoutError(f"{self.name}/{name} not ready; see {self.dir / name}.log")

    def _log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def _healthy(self) -> bool:
        return check_http(f"http://127.0.0.1:{self.port}/health", 1.0)[0]

    def worker_stats(self, role: str, index: int = 0) -> pb.StatsResponse:
        port = self._base_ports[role] + index * PORT_STRIDE
        return worker_stats(f"127.0.0.1:{port}", role)

    def metrics_text(self) -> str:
        """The router's Prometheus exposition."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.read().decode()

    def stop(self, grace_s: float = 20.0) -> bool:
        """Router first, then the workers; True if all exited cleanly on SIGTERM."""
        clean = True
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                clean &= proc.wait(grace_s) == 0
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                clean = False
        if clean:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"{self.name}: unclean stop; logs kept in {self.dir}", file=sys.stderr)
        return clean
