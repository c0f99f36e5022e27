"""The router's server stops within its drain grace: requests in flight get ``grace_s``,
then what is still open is closed within ``DrainingServer.CLOSE_S`` (uvicorn's own
graceful wait was the grace again, after the drain's: a stop took twice the grace, past
what the supervisors wait, and the router was killed before its cleanup)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from router.main import DrainingServer


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
    state = SimpleNamespace(draining=False, num_inflight=1)  # the stream, never done
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
