"""Real worker processes for integration tests: configs on free ports, start, wait, stop."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.loadgen.pinned_stack import free_port_base, port_is_free  # noqa: F401
from common.config import PORT_STRIDE

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, *args: str) -> None:
    """Run ``python -m benchmarks.<module> ARGS`` in this process; fail the test unless it
    returns (or exits 0). In this process, not a fresh one: a fresh interpreter spent
    ~3.7 s importing torch and transformers per benchmark, ~1 minute of the suite's CPU
    over its smoke runs. What a benchmark may change for the whole process (torch's
    thread count, its global RNG, ``sys.argv``) is put back afterwards; the pytest
    timeout bounds a hang."""
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    argv = sys.argv
    sys.argv = [f"benchmarks/{module}.py", *args]
    try:
        runpy.run_module(f"benchmarks.{module}", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        assert exit_.code in (None, 0), f"benchmarks.{module} exited {exit_.code!r}"
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)


def kv_transfer_section(connector: str, shared_dir: Path) -> dict[str, Any]:
    """A deployment's ``kv_transfer`` section for ``connector``; shared storage keeps its
    files under ``shared_dir``."""
    transfer: dict[str, Any] = {"connector": connector}
    if connector == "shared_storage":
        transfer["shared_dir"] = str(shared_dir)
    return transfer


def write_config(
    path: Path, model: Path, num_prefill: int = 1, num_decode: int = 1, **sections: dict[str, Any]
) -> Path:
    """A deployment YAML with the tiny model on free ports; ``sections`` merge in. The
    router's and the workers' ports come from one free range: picked apart, the router's
    port could fall in a worker's (the config check refused such a stack in a test run).
    Each role's ports leave room for one replica more (scale-out tests start it)."""
    prefill_span = PORT_STRIDE * (max(num_prefill, 1) + 1)
    decode_span = PORT_STRIDE * (num_decode + 1)
    base = free_port_base(PORT_STRIDE + prefill_span + decode_span)
    prefill_port = base + PORT_STRIDE  # the router takes the first stride's first port
    config: dict[str, Any] = {
        "model": str(model),
        "engine": {"kv_cache_bytes": 64 << 20, "max_model_len": 1024},
        "prefill": {"replicas": num_prefill, "port": prefill_port, "drain_grace_s": 10},
        "decode": {
            "replicas": num_decode,
            "port": prefill_port + prefill_span,
            "drain_grace_s": 10,
        },
        "router": {"port": base},
        "kv_transfer": {"lease_s": 4.0, "timeout_s": 2.0},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class WorkerProcess:
    role: str
    index: int
    config_path: Path
    log_path: Path
    overrides: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        config = yaml.safe_load(self.config_path.read_text())
        for item in self.overrides:
            key, value = item.split("=", 1)
            if key == f"{self.role}.port":
                config[self.role]["port"] = int(value)
        return f"127.0.0.1:{config[self.role]['port'] + self.index * PORT_STRIDE}"

    def start(self) -> WorkerProcess:
        cmd = [
            sys.executable,
            "-m",
            "deploy.cli",
            "--log-level",
            "INFO",
            self.role,
            "--config",
            str(self.config_path),
            "--index",
            str(self.index),
        ]
        for item in self.overrides:
            cmd += ["--set", item]
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        return self

    def wait_ready(self, timeout: float = 90.0) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.role} {self.index} exited:\n{self.log()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.role} {self.index} not ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, signum: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_workers(workers: list[WorkerProcess], timeout: float = 120.0) -> list[WorkerProcess]:
    """Start all at once (model loading overlaps), then wait for each."""
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.wait_ready(timeout)
    except BaseException:
        for worker in workers:
            worker.stop(5)
        raise
    return workers


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
