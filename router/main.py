"""Entry point of the router: ``pdserve router --config FILE``."""

from __future__ import annotations

import contextlib
import logging

import uvicorn

from common.config import PdserveConfig
from router.app import create_app
from router.state import RouterState

logger = logging.getLogger(__name__)


def run(config: PdserveConfig) -> int:
    state = RouterState.build(config)
    app = create_app(state)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await state.start()
        logger.info(
            "router on http://%s:%d serving %s", config.router.host, config.router.port,
            state.model.served_name,
        )  # fmt: skip
        print(f"pdserve router ready on http://{config.router.host}:{config.router.port}/v1",
              flush=True)  # fmt: skip
        try:
            yield
        finally:
            await state.stop()

    app.router.lifespan_context = lifespan
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.router.host,
            port=config.router.port,
            log_level="warning",
            timeout_graceful_shutdown=int(config.router.drain_grace_s),
            lifespan="on",
        )
    )
    server.run()
    return 0
