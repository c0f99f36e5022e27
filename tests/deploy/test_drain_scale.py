"""Graceful drain, scaling and restarts under load, with real processes: ``pdserve up``
(router + workers), extra workers started as an operator would (``pdserve decode --index
N``), a real redis-server, and streaming clients through the router that must see zero
failures."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys

from common.config_loader import load_config
from common.registry import RedisRegistry
from deploy.up import Stack
from tests.common.redis_server import redis_server
from tests.deploy.load import MODEL, StreamingLoad, wait_busy, wait_serving_requests
from tests.support.polling import eventually
from tests.support.processes import ROOT, WorkerProcess, start_workers, write_config
from tests.support.stack import launch_up, start_up_stack

ROUTER = {"served_model_name": MODEL, "min_disagg_tokens": 0, "refresh_interval_s": 0.3}


def wait_for(condition, timeout_s: float) -> bool:
    """``eventually``, every 0.2 s: some conditions start a probe process."""
    return eventually(condition, timeout_s, interval_s=0.2)


def probe(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "deploy.health_cmd", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT)


def test_sigterm_drains_a_decode_worker_under_streaming_load(tiny_llama, tmp_path):
    """Static registry: SIGTERM to a decode worker with streams in flight. Its streams
    finish, the router stops placing on it (health NOT_SERVING, refusals retried on the
    other worker), it exits 0, and no client request fails."""
    config = write_config(tmp_path / "c.yaml", tiny_llama, num_decode=2, router=ROUTER)
    stack = start_up_stack(config, tmp_path / "home")
    decode_1 = f"127.0.0.1:{stack.config['decode']['port'] + 10}"

    async def body():
        load = StreamingLoad(f"{stack.base_url}/v1")
        load.start()
        await wait_serving_requests(decode_1, "decode")
        await wait_busy(decode_1, "decode")
        os.kill(stack.children()["decode-1"], signal.SIGTERM)
        done = load.result.completed
        await load.wait_completed(done + 12)  # served by decode-0 alone meanwhile
        return await load.stop()

    try:
        # The probe compose healthchecks run: SERVING worker, router /health 200.
        assert probe("--grpc", decode_1).returncode == 0
        assert probe("--http", f"{stack.base_url}/health").returncode == 0
        result = asyncio.run(body())
        assert result.failures == [] and result.completed >= 12
        # Drained and exited cleanly (the launcher reports it; the gRPC server's own
        # shutdown takes about a second after the last stream ends).
        assert wait_for(lambda: "decode-1 exited (0)" in stack.log(), 20), stack.log()
        gone = probe("--grpc", decode_1)
        assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
        port = stack.base_url.rsplit(":", 1)[1]  # each stack logs under its router's port
        drained = (tmp_path / "home" / "logs" / port / "decode-1.log").read_text()
        assert "draining" in drained and "still in flight" not in drained
    finally:
        assert stack.stop() == 0, stack.log()


def test_scale_out_and_in_with_redis_while_requests_flow(tiny_llama, tmp_path):
    """Redis registry: a decode and a prefill worker started while the stack serves are
    picked up by the router without a restart; SIGTERM to them (scale-in) drains them
    while streams are in flight; they deregister, exit 0, and no request fails."""
    with redis_server(tmp_path) as url:
        # The default TTL: expiry is not under test here (a drained worker deregisters),
        # and a short one can lapse on a CPU-starved CI machine.
        registry_section = {"redis_url": url, "ttl_s": 10.0, "heartbeat_s": 1.0}
        config = write_config(
            tmp_path / "c.yaml", tiny_llama, registry=registry_section, router=ROUTER
        )
        stack = start_up_stack(config, tmp_path / "home")
        # Replica index 1 of each role: beyond the config's replica count, which a Redis
        # registry allows.
        extra = [WorkerProcess(role, 1, config, tmp_path / f"{role}-1.log")
                 for role in ("decode", "prefill")]  # fmt: skip
        registry = RedisRegistry(url, ttl_s=10.0)

        async def body():
            load = StreamingLoad(f"{stack.base_url}/v1")
            load.start()
            await load.wait_completed(3)
            await asyncio.to_thread(start_workers, extra)
            for worker in extra:  # scale-out: the router uses them without a restart
                await wait_serving_requests(worker.address, worker.role)
            for worker in extra:  # scale-in under load
                await wait_busy(worker.address, worker.role)
                worker.signal(signal.SIGTERM)
            codes = [await asyncio.to_thread(w.proc.wait, 30) for w in extra]
            done = load.result.completed
            await load.wait_completed(done + 6)
            return codes, await load.stop()

        try:
            codes, result = asyncio.run(body())
            assert codes == [0, 0], [w.log() for w in extra]
            assert all("still in flight" not in w.log() for w in extra)
            assert result.failures == [] and result.completed >= 9
            listed = sorted(w.grpc_address for w in registry.list_workers())
            assert listed == sorted(
                f"127.0.0.1:{stack.config[role]['port']}" for role in ("decode", "prefill")
            )
        finally:
            for worker in extra:
                worker.stop(5)
            registry.close()
            assert stack.stop() == 0, stack.log()


def test_a_killed_worker_or_router_is_restarted_and_serves_again(tiny_llama, tmp_path):
    """``pdserve up`` restarts a worker that died (SIGKILL: an OOM kill, say) after a
    backoff; the router picks it up once SERVING, and requests succeed again. A killed
    router comes back too, and the workers kept running meanwhile."""
    config = write_config(tmp_path / "c.yaml", tiny_llama, router=ROUTER)
    stack = start_up_stack(config, tmp_path / "home")
    decode_0 = f"127.0.0.1:{stack.config['decode']['port']}"
    try:
        os.kill(stack.children()["decode-0"], signal.SIGKILL)
        assert wait_for(lambda: "decode-0 restarted" in stack.log(), 30), stack.log()
        assert "decode-0 exited (-9)" in stack.log()
        # Said in the worker's own log too (it just began again, saying nothing of why).
        (own_log,) = (tmp_path / "home" / "logs").glob("*/decode-0.log")
        assert "ERROR launcher: decode-0 exited (-9): killed by SIGKILL" in own_log.read_text()
        assert wait_for(lambda: probe("--grpc", decode_0).returncode == 0, 120), stack.log()
        assert wait_for(lambda: probe("--http", f"{stack.base_url}/health").returncode == 0,
                        30)  # fmt: skip
        load = StreamingLoad(f"{stack.base_url}/v1")

        async def body():
            load.start()
            await load.wait_completed(3)
            return await load.stop()

        result = asyncio.run(body())
        assert result.failures == [] and result.completed >= 3
        workers = {n: pid for n, pid in stack.children().items() if n != "router"}
        os.kill(stack.children()["router"], signal.SIGKILL)
        assert wait_for(lambda: "router restarted" in stack.log(), 30), stack.log()
        assert wait_for(lambda: probe("--http", f"{stack.base_url}/health").returncode == 0,
                        60), stack.log()  # fmt: skip
        assert {n: pid for n, pid in stack.children().items() if n != "router"} == workers
        load = StreamingLoad(f"{stack.base_url}/v1")
        result = asyncio.run(body())
        assert result.failures == [] and result.completed >= 3
    finally:
        assert stack.stop() == 0, stack.log()


def test_sigterm_while_workers_load_leaves_nothing_behind(tiny_llama, tmp_path):
    """SIGTERM (or Ctrl-C) to ``pdserve up`` while its workers still load stops them and
    the router (started beside them) too, instead of leaving them running under pid 1."""
    config = write_config(tmp_path / "c.yaml", tiny_llama, router=ROUTER)
    stack = launch_up(config, tmp_path / "home")
    try:
        assert wait_for(lambda: len(stack.children()) == 3, 60), stack.log()
        assert "pdserve is up" not in stack.log()
        children = stack.children()
    finally:  # a failed check above must not leave the stack running
        stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(90) == 0, stack.log()
    for name, pid in children.items():
        assert not os.path.exists(f"/proc/{pid}"), f"{name} ({pid}) was left running"


def test_a_killed_launcher_takes_its_children_down(tiny_llama, tmp_path):
    """SIGKILL of ``pdserve up`` itself (no chance to stop anything): its workers and
    router get SIGTERM from the kernel (parent-death signal), drain and exit, instead of
    running on under pid 1."""
    config = write_config(tmp_path / "c.yaml", tiny_llama, router=ROUTER)
    stack = start_up_stack(config, tmp_path / "home")
    children = list(stack.children().values())
    assert len(children) == 3
    stack.proc.kill()
    stack.proc.wait()
    assert wait_for(lambda: not any(map(_running, children)), 60), stack.log()
    # The resolved config it gave its children stays (nothing ran to remove it); the
    # next launcher on this home and port removes it.
    log_dir = tmp_path / "home" / "logs" / str(stack.config["router"]["port"])
    left = log_dir / f"config-{socket.gethostname()}-{stack.proc.pid}.yaml"
    assert left.exists()
    fresh = Stack(load_config(str(config)), log_dir)
    assert not left.exists() and fresh.config_path.exists()
    # A log directory removed while the launcher runs: a restart writes the config again.
    shutil.rmtree(log_dir)
    proc = fresh._spawn("decode-0", ["decode", "--index", "0"])
    proc.terminate()
    proc.wait(60)
    assert fresh.config_path.exists()
    fresh.config_path.unlink()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
