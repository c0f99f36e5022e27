"""Entry point of the router: ``pdserve router --config FILE``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

import uvicorn
from prometheus_client import disable_created_metrics

from common.api_keys import api_keys_from_env
from common.config import PdserveConfig
from common.gc_heap import freeze_startup_heap
from common.hosts import host_port
from common.internal_auth import InternalAuth
from common.listen_sockets import bind_listeners, listen_error
from router.app import create_app
from router.http_protocol import guarded_protocol, quiet_client_noise
from router.state import RouterState

logger = logging.getLogger(__name__)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The router's sockets, bound before anything starts (``common/listen_sockets.py``): a
    port in use is one error naming it (uvicorn binds after the app's start-up, which had
    printed "ready")."""
    try:
        return bind_listeners(host, port)
    except OSError as exc:
        raise listen_error("router.port", host, port, exc) from None


def with_env_api_keys(
    config: PdserveConfig, environ: Mapping[str, str] = os.environ
) -> PdserveConfig:
    """``config`` with the keys ``PDSERVE_API_KEYS`` lists added to ``router.api_keys``
    (rendered deployments give them only this way: ``common/api_keys.py``)."""
    env_keys = api_keys_from_env(environ)
    if not env_keys:
        return config
    router = dataclasses.replace(config.router, api_keys=[*config.router.api_keys, *env_keys])
    return dataclasses.replace(config, router=router)


def run(config: PdserveConfig) -> int:
    # No ``*_created`` series beside every counter and histogram: they double what is
    # scraped for nothing a dashboard reads (vLLM turns them off too). A flag of
    # prometheus_client's for the whole process, so set here, where the process starts.
    disable_created_metrics()
    config = with_env_api_keys(config)
    sockets = listening_sockets(config.router.host, config.router.port)
    try:
        _server(config, RouterState.build(config, InternalAuth.from_env())).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    return 0


def _server(config: PdserveConfig, state: RouterState) -> DrainingServer:
    app = create_app(state)
    quiet_client_noise()

    address = host_port(config.router.host, config.router.port)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await state.start()
        freeze_startup_heap()
        logger.info("router on http://%s serving %s", address, state.model.served_name)
        print(f"pdserve router ready on http://{address}/v1", flush=True)
        try:
            yield
        finally:
            await state.stop()

    app.router.lifespan_context = lifespan
    return DrainingServer(
        state,
        config.router.drain_grace_s,
        uvicorn.Config(
            app,
            host=config.router.host,
            port=config.router.port,
            log_level="warning",
            # (uvicorn's own lines through the process's handler: timestamped, as ours)
            log_config=None,
            # uvicorn's "auto" would fall back to asyncio + h11 when these are missing,
            # quietly spending more CPU per streamed token (``benchmarks/router_stream.py
            # --before-plain``; DESIGN_NOTES, Router). httptools' protocol, with bounds
            # on a request's head (``router/http_protocol.py``).
            loop="uvloop",
            http=guarded_protocol(state.metrics.refused),
            timeout_keep_alive=config.router.keep_alive_s,  # type: ignore[arg-type]
            lifespan="on",
        ),
    )


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: answer 503 (Retry-After) to new requests and /health, let the
    requests in flight finish (at most ``grace_s``), then stop: uvicorn closes what is
    still open within ``CLOSE_S``. (Its own graceful wait was ``grace_s`` too, after the
    drain's: a stop took twice the grace, past what ``pdserve up``, compose and
    Kubernetes wait, so a router still busy at the end was killed before its cleanup.)
    Replies still running when the grace ends get ``CUT_S`` to end with an error
    (``RouterState.stopping``) before the close."""

    CLOSE_S = 2
    CUT_S = 0.5  # for the replies still running to write their error (``stopping``)

    def __init__(self, state: RouterState, grace_s: float, config: uvicorn.Config) -> None:
        config.timeout_graceful_shutdown = self.CLOSE_S
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:  # a second signal: stop now, replies ending with an error
            # Not uvicorn's own handler: it re-raised the signal once stopped, so the
            # router died by it (exit -15), and ``pdserve up`` restarted it. (Not
            # force_exit either: it skips the lifespan's shutdown, the router's cleanup;
            # the close waits at most CLOSE_S.)
            self.state.stopping = True
            self.should_exit = True
            return
        logger.info("draining: %d sequences in flight", self.state.num_inflight)
        self.state.draining = True
        deadline = time.monotonic() + self.grace_s

        def busy() -> bool:
            # Requests still on their way to admission too (tokenizing, compiling): they
            # get their 503 there; stopped under them, they got a cut stream.
            return bool(self.state.num_inflight or self.state.num_open_requests)

        def watch() -> None:
            while busy() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.state.num_inflight:  # cut what still runs, each with its error
                logger.warning("drain grace over: ending %d sequences", self.state.num_inflight)
                self.state.stopping = True
                cut_by = time.monotonic() + self.CUT_S
                while self.state.num_inflight and time.monotonic() < cut_by:
                    time.sleep(0.05)
            self.should_exit = True

        threading.Thread(target=watch, daemon=True).start()
