"""The router's server stops within its drain grace: requests in flight get ``grace_s``,
then what is still open is closed within ``DrainingServer.CLOSE_S`` (uvicorn's own
graceful wait was the grace again, after the drain's: a stop took twice the grace, past
what the supervisors wait, and the router was killed before its cleanup)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from router.main import DrainingServer
from tests.support.processes import ROOT, write_config


async def forever(scope, receive, send) -> None:
    """A stream that never ends (a long generation)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    while True:
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await asyncio.sleep(0.1)


def test_a_drain_with_a_stream_still_running_ends_within_its_grace():
    grace_s = 1.0
    state = SimpleNamespace(draining=False, stopping=False, num_inflight=1,
                            num_open_requests=0)  # the stream, never done  # fmt: skip
    config = uvicorn.Config(forever, host="127.0.0.1", port=0, lifespan="off",
                            log_level="warning")  # fmt: skip
    server = DrainingServer(state, grace_s, config)  # type: ignore[arg-type]
    received: list[int] = []

    def read(port: int) -> None:
        try:
            with httpx.stream("GET", f"http://127.0.0.1:{port}/", timeout=30) as reply:
                for chunk in reply.iter_bytes():
                    received.append(len(chunk))
        except httpx.HTTPError:
            pass  # cut at the end of the grace

    async def main() -> float:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader = threading.Thread(target=read, args=(port,), daemon=True)
        reader.start()
        while not received:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        server.handle_exit(15, None)
        assert state.draining
        await asyncio.wait_for(serving, 10)
        return time.monotonic() - start

    took = asyncio.run(main())
    assert grace_s <= took < grace_s + DrainingServer.CLOSE_S + 1.0, took


def serving(state: SimpleNamespace, app=forever) -> tuple[DrainingServer, asyncio.Task]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = DrainingServer(state, 30.0, config)  # type: ignore[arg-type]
    return server, asyncio.create_task(server.serve())


def test_the_drain_waits_for_requests_not_yet_admitted():
    """A request that passed the draining check and then awaited (tokenizing, compiling
    its grammar) was not yet counted as in flight: the drain, seeing nothing, stopped the
    server under it (a cut stream, or uvicorn's plain 500). Open HTTP requests count."""
    state = SimpleNamespace(draining=False, stopping=False, num_inflight=0, num_open_requests=1)

    async def main() -> tuple[bool, bool]:
        server, task = serving(state)
        while not server.started:
            await asyncio.sleep(0.01)
        server.handle_exit(15, None)
        await asyncio.sleep(0.5)
        waited = not task.done()
        state.num_open_requests = 0  # it got its 503 at admission
        await asyncio.wait_for(task, 10)
        return waited, state.stopping

    assert asyncio.run(main()) == (True, False)


def test_a_second_signal_stops_now_and_the_router_does_not_die_by_it():
    """uvicorn's own handler re-raised the signal once stopped: the router died by it
    (exit -15) and ``pdserve up`` restarted it. The replies still running end with their
    error (``stopping``)."""
    state = SimpleNamespace(draining=False, stopping=False, num_inflight=1, num_open_requests=1)

    async def main() -> float:
        server, task = serving(state)
        while not server.started:
            await asyncio.sleep(0.01)
        server.handle_exit(15, None)
        assert not state.stopping
        start = time.monotonic()
        server.handle_exit(15, None)
        assert state.stopping and server.should_exit and not server.force_exit
        assert server._captured_signals == []  # (what uvicorn raises again at its end)
        server.handle_exit(2, None)  # a third: the same (force_exit skips the cleanup)
        assert not server.force_exit and server._captured_signals == []
        await asyncio.wait_for(task, 10)
        return time.monotonic() - start

    assert asyncio.run(main()) < DrainingServer.CLOSE_S + 1.0


def test_a_router_on_ipv6_loopback_says_its_url_in_brackets(tiny_llama, tmp_path):
    """It printed ``http://::1:8000/v1``, which no client reads as a URL; it answers there."""
    with socket.socket(socket.AF_INET6) as probe:  # a free port on ::1
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    config = write_config(tmp_path / "config.yaml", tiny_llama, router={"port": port})
    router = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "router", "--config", str(config),
         "--set", "router.host='::1'"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert router.stdout is not None
        lines = iter(router.stdout.readline, "")
        ready = next((line for line in lines if "ready on" in line), "")
        assert ready.strip() == f"pdserve router ready on http://[::1]:{port}/v1"
        models = httpx.get(f"http://[::1]:{port}/v1/models", timeout=30)
        assert models.status_code == 200, models.text
    finally:
        router.terminate()
        router.wait(60)
