"""``pdserve up``'s stop and drains: the router first, then every worker at once, each
killed when its own deadline passes (not one after another); a second signal kills what
is left; a worker the plan drains is killed if it outlives its grace, and starts its
backoff over if the plan brings it back; a /metrics reply cut off mid-way reads as no
answer, not a crash."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from common.config import Role
from common.config_loader import load_config
from common.prometheus_text import fetch
from deploy import up
from deploy.up import Stack
from tests.deploy.test_render import DEMO

GRACE = ["router.drain_grace_s=0.2", "prefill.drain_grace_s=0.2", "decode.drain_grace_s=0.2",
         "decode.replicas=4"]  # fmt: skip


def stubborn(marker: Path | None = None) -> subprocess.Popen:
    """A process that ignores SIGTERM (a stuck drain); with ``marker``, one that writes
    the time it got SIGTERM there and exits."""
    if marker is None:
        script = "trap '' TERM; sleep 60 & wait; sleep 60"
    else:
        script = f"trap 'date +%s.%N > {marker}; exit 0' TERM; sleep 60 & wait"
    return subprocess.Popen(["bash", "-c", script])


@pytest.fixture
def stack(tmp_path, monkeypatch) -> Stack:
    monkeypatch.setattr(up, "_SHUTDOWN_S", 0.5)
    return Stack(load_config(str(DEMO), GRACE), tmp_path)


def test_every_worker_gets_its_deadline_at_once_and_the_router_stops_first(stack, tmp_path):
    """A router and three workers ignoring SIGTERM, 0.7 s each: the router's 0.7 s, then
    the workers' 0.7 s together (it was 0.7 s after each in turn). A worker the plan
    started after the router (appended after it) gets SIGTERM only once the router is
    gone (it got it first)."""
    marker = tmp_path / "late-term"
    stack.children = [("prefill-0", stubborn()), ("decode-0", stubborn()),
                      ("router", stubborn()), ("decode-1", stubborn()),
                      ("decode-2", stubborn(marker))]  # fmt: skip
    time.sleep(0.3)  # the traps are set
    started, started_wall = time.monotonic(), time.time()
    stack.stop()
    elapsed = time.monotonic() - started
    assert all(proc.poll() is not None for _, proc in stack.children)
    assert 1.4 <= elapsed < 2.2, elapsed
    assert float(marker.read_text()) - started_wall >= 0.65  # after the router's 0.7 s


def test_a_drained_router_stops_the_stack_with_success(stack):
    """A router that exits 0 was drained on purpose (its own SIGTERM): the stack stops
    with 0, so a supervisor restarting on failure leaves it stopped; one that failed
    under --no-restart stops it with 1."""
    for command, restart, code in ((["true"], True, 0), (["false"], False, 1)):
        router = subprocess.Popen(command)
        router.wait()
        stack.children = [("router", router)]
        stack.restart = restart
        assert stack.wait() == code


def test_a_second_signal_kills_what_is_left_at_once(stack, monkeypatch):
    monkeypatch.setattr(up, "_SHUTDOWN_S", 60.0)
    stack.children = [("router", stubborn()), ("decode-0", stubborn())]
    time.sleep(0.3)

    def second_ctrl_c() -> None:
        time.sleep(0.5)
        stack._num_signals += 1  # what the signal handler counts

    threading.Thread(target=second_ctrl_c).start()
    started = time.monotonic()
    stack.stop()
    assert time.monotonic() - started < 3
    assert all(proc.poll() is not None for _, proc in stack.children)


def test_a_worker_the_plan_drains_is_killed_once_it_outlives_its_grace(stack):
    proc = stubborn()
    stack.children = [("decode-3", proc)]
    stack._drain_deadlines["decode-3"] = time.monotonic() + 0.3
    stack._kill_stuck_drains()
    assert proc.poll() is None  # not yet
    time.sleep(0.4)
    stack._kill_stuck_drains()
    assert proc.poll() is not None and not stack._drain_deadlines


def test_a_metrics_reply_cut_off_reads_as_no_answer():
    """A router killed mid-reply (an OOM kill): ``http.client.IncompleteRead`` escaped
    ``fetch`` and took the launcher, and the stack, down."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_half() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npdserve_x 1\n")
        conn.close()

    thread = threading.Thread(target=answer_half)
    thread.start()
    try:
        assert fetch(f"http://127.0.0.1:{port}/metrics", timeout_s=5) is None
    finally:
        thread.join()
        server.close()


def test_a_hang_up_stops_the_stack_as_ctrl_c_does(stack):
    """An ssh session dropping sends SIGHUP: it killed the launcher without its stop()."""
    kinds = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {kind: signal.getsignal(kind) for kind in kinds}
    try:
        stack.handle_signals()
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 5
        while not stack.stop_signal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stack.stop_signal == signal.SIGHUP
    finally:
        for kind, handler in saved.items():
            signal.signal(kind, handler)


def test_the_start_timeout_is_a_flag_with_a_large_models_default(monkeypatch, capsys):
    """300 s was fixed: a tensor-parallel shard may take 1800 s to load a large model."""
    from deploy.cli import main

    seen = []
    monkeypatch.setattr(up, "run", lambda config, restart, start_timeout_s: seen.append(
        start_timeout_s) or 0)  # fmt: skip
    assert main(["up"]) == 0 and main(["up", "--start-timeout", "42"]) == 0
    assert seen == [up.DEFAULT_START_TIMEOUT_S, 42.0] and up.DEFAULT_START_TIMEOUT_S == 1800
    assert main(["up", "--start-timeout", "0"]) == 2
    assert "--start-timeout must be > 0" in capsys.readouterr().err


def planned_stack(tmp_path, monkeypatch, last: list[str], restart: bool = True) -> Stack:
    """A stack whose plan wants 1 prefill and 2 decode workers: prefill-0 and decode-0
    running, decode-1 a process that ran ``last`` and ended."""
    overrides = ["planner.profile=/p.json", "planner.autoscale=true", "decode.replicas=2"]
    stack = Stack(load_config(str(DEMO), overrides), tmp_path, restart=restart)
    monkeypatch.setattr(up, "read_plan", lambda url: {Role.PREFILL: 1, Role.DECODE: 2})
    ended = subprocess.Popen(last)
    ended.wait()
    running = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    stack.children = [("prefill-0", running[0]), ("decode-0", running[1]), ("decode-1", ended)]
    for name, _ in stack.children:
        stack._restarts[name] = up._Restarts(name.replace("-", " --index ").split())
    return stack


def stop_planned(stack: Stack) -> None:
    for _, proc in stack.children:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stack.config_path.unlink()


def test_a_worker_the_plan_starts_again_starts_its_backoff_over(tmp_path, monkeypatch):
    """A worker that crash-looped (its backoff at 30 s), then was drained by the plan,
    is a new start when the plan brings it back: a failure soon after waits 1 s. (It
    waited 30 s: its backoff and start time were those of the old crash loop.)"""
    stack = planned_stack(tmp_path, monkeypatch, ["true"])
    drained = dict(stack.children)["decode-1"]
    stack._restarts["decode-1"].started_at = time.monotonic() - 20  # its last restart
    stack._restarts["decode-1"].backoff_s = 30.0
    stack._drained_by_plan.add("decode-1")
    try:
        stack._follow_plan(set())
        started = dict(stack.children)["decode-1"]
        assert started is not drained and "decode-1" not in stack._drained_by_plan
        started.kill()  # it fails at once
        started.wait()
        stack._schedule_restart("decode-1")
        assert stack._restarts["decode-1"].due_at - time.monotonic() < 1.5
    finally:
        stop_planned(stack)


def test_under_no_restart_a_failed_worker_stays_down_whatever_the_plan(tmp_path, monkeypatch):
    """The plan counted a failed worker as missing and started it again at every tick
    (every 0.1 s at interval_s 0.1), ignoring ``--no-restart`` and the backoff."""
    stack = planned_stack(tmp_path, monkeypatch, ["false"], restart=False)
    failed = dict(stack.children)["decode-1"]
    try:
        stack._follow_plan(set())
        assert dict(stack.children)["decode-1"] is failed
    finally:
        stop_planned(stack)
