"""A port another process holds is one line naming it, before anything loads: the router
had printed "ready" and then failed in uvicorn's bind (exit 3); a worker printed gRPC's
38-line traceback. A second worker on a serving worker's port is refused at once (gRPC's
SO_REUSEPORT let it bind beside the first and take a share of its calls)."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from common.config import PORT_STRIDE
from tests.deploy.test_cli import run_cli
from tests.support.processes import WorkerProcess, free_port_base, start_workers, write_config
from tests.support.stack import launch_up


def _held_port() -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_a_router_port_in_use_is_one_line_before_it_starts(tiny_llama, tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_llama)
    with _held_port() as holder:
        port = holder.getsockname()[1]
        out = run_cli("router", "--config", str(config), "--set", f"router.port={port}")
    assert out.returncode == 2, out.stderr
    assert "ready" not in out.stdout and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: router.port: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another process has it)"
    )


def test_a_second_worker_on_a_serving_workers_port_is_refused_at_once(tiny_llama, tmp_path):
    config = write_config(tmp_path / "config.yaml", tiny_llama)
    (first,) = start_workers([WorkerProcess("prefill", 0, config, tmp_path / "first.log")])
    try:
        started = time.monotonic()
        second = run_cli("prefill", "--config", str(config))
        assert second.returncode == 2, second.stderr
        assert f"error: prefill.port: cannot listen on {first.address}" in second.stderr
        assert "Traceback" not in second.stderr and "loading the model" not in second.stderr
        assert time.monotonic() - started < 60
        with _held_port() as holder:  # any other process's
            port = holder.getsockname()[1]
            out = run_cli("decode", "--config", str(config), "--set", f"decode.port={port}")
        assert out.returncode == 2 and "decode.port: cannot listen" in out.stderr, out.stderr
    finally:
        assert first.stop() == 0, first.log()


@pytest.mark.parametrize(("offset", "name", "connector"),
                         [(1, "KV events", "nixl"), (3, "kv_transfer", "nccl")])  # fmt: skip
def test_a_workers_other_port_in_use_is_one_line_before_it_loads(
    tiny_llama, tmp_path, offset, name, connector
):
    """Its events, replay and (NCCL) connector ports were bound only after the model
    loaded: a port in use failed then with a traceback, and the NCCL one hung the
    worker's exit for ever (``pdserve up`` waited out its 30 min start timeout)."""
    config = write_config(tmp_path / "config.yaml", tiny_llama)
    # Below the ephemeral range, all of the worker's ports free: a held ephemeral port's
    # neighbour (the worker's gRPC port) was once taken by another process's connection.
    base = free_port_base(PORT_STRIDE)
    port = base + offset
    with socket.create_server(("127.0.0.1", port)):
        started = time.monotonic()
        out = run_cli("prefill", "--config", str(config), "--set", f"prefill.port={base}",
                      "--set", f"kv_transfer.connector={connector}")  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: prefill.port: cannot listen on 127.0.0.1:{port} ({name}): Address already in use"
    )
    assert "Traceback" not in out.stderr and "loading the model" not in out.stderr
    assert time.monotonic() - started < 60


def test_up_names_what_this_machine_lacks_before_starting_anything(tiny_llama, tmp_path):
    """Held ports (the router's, a worker's) and a model directory that is not there:
    each one line, exit 2, no child started."""
    config = write_config(tmp_path / "config.yaml", tiny_llama)
    with _held_port() as router_holder, _held_port() as worker_holder:
        router_port, worker_port = router_holder.getsockname()[1], worker_holder.getsockname()[1]
        decode_base = worker_port - 1  # the held one is decode's events port
        if decode_base <= router_port < decode_base + 5:
            pytest.skip("the two free ports came too close for this layout")
        out = run_cli("up", "--config", str(config), "--set", f"router.port={router_port}",
                      "--set", f"decode.port={decode_base}", "--set", f"model={tmp_path / 'gone'}",
                      env={"PDSERVE_HOME": str(tmp_path / "home")})  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: model: {tmp_path / 'gone'} does not exist (pdserve serves a checkpoint "
        "directory on this machine; download the model first)",
        f"error: router.port: cannot listen on 127.0.0.1:{router_port}: Address already in "
        "use (another stack?)",
        f"error: decode.port: cannot listen on 127.0.0.1:{worker_port} (KV events): Address "
        "already in use (another stack?)",
    ]
    assert not (tmp_path / "home" / "logs").exists()


def test_up_says_why_a_process_failed_to_start(tiny_llama, tmp_path):
    """A checkpoint without its weights: the first process to fail is named with the
    last thing it said (its exception), not only "exited (1); see <log>"."""
    model = tmp_path / "no-weights"
    model.mkdir()
    for path in tiny_llama.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, model / path.name)
    config = write_config(tmp_path / "config.yaml", model)
    stack = launch_up(config, tmp_path / "home", restart=False)
    try:
        assert stack.proc.wait(120) == 1
    finally:
        stack.stop()
    failed = [line for line in stack.log().splitlines() if " exited (" in line]
    assert failed and "safetensors" in failed[0], stack.log()


def test_the_cause_is_what_this_start_wrote_or_the_signal_that_killed_it(tiny_llama, tmp_path):
    """Logs are appended to across starts and stacks: an error an earlier start wrote was
    named as the cause of a later failure."""
    from common.config_loader import load_config
    from deploy.up import Stack

    stack = Stack(
        load_config(str(write_config(tmp_path / "c.yaml", tiny_llama))), tmp_path / "logs"
    )
    (tmp_path / "logs" / "prefill-0.log").write_text("error: an earlier start's failure\n")
    proc = stack._spawn("prefill-0", ["prefill", "--index", "7"])  # no such replica
    line = stack._exit_line("prefill-0", proc.wait(60))
    assert "no replica 7" in line and "earlier" not in line, line
    proc = stack._spawn("prefill-0", ["prefill"])
    proc.kill()
    assert ": killed by SIGKILL; see " in stack._exit_line("prefill-0", proc.wait(60))
    stack.config_path.unlink()


def test_a_home_that_cannot_be_made_is_named(tmp_path):
    """``PDSERVE_HOME`` where no directory can be made: the error named the path only."""
    home = tmp_path / "file"
    home.write_text("")  # (a file where the directory would go)
    out = run_cli("up", env={"PDSERVE_HOME": str(home / "home")})
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1].endswith("(PDSERVE_HOME)"), out.stderr
