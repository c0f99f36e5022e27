"""Entry point of a worker process: ``pdserve prefill|decode --config FILE [--index N]``."""

from __future__ import annotations

import asyncio
import logging
import signal

from common.config import PdserveConfig, Role
from common.internal_auth import InternalAuth
from proto import pdserve_pb2_grpc as pb_grpc
from worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


async def serve(config: PdserveConfig, role: Role, index: int) -> int:
    """Run one worker until SIGTERM/SIGINT, then drain and exit; the exit code (1 if the
    engine failed)."""
    runtime = WorkerRuntime(config, role, index, InternalAuth.from_env())
    if role is Role.PREFILL:
        from prefill_service.servicer import PrefillServicer

        servicer = PrefillServicer(runtime)
        add = lambda server: pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)  # noqa: E731
    else:
        from decode_service.servicer import DecodeServicer

        servicer = DecodeServicer(runtime)
        add = lambda server: pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)  # noqa: E731

    loop = asyncio.get_running_loop()
    drain_task: list[asyncio.Task] = []

    def on_signal(signum: int) -> None:
        logger.info("signal %d: draining", signum)
        if not drain_task:
            drain_task.append(asyncio.ensure_future(runtime.drain(servicer.in_flight)))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        started = await runtime.start(add, freeze_heap=True)
    except BaseException:
        await runtime.stop()
        raise
    if started:  # else a signal came while loading, and its drain stops the worker
        if role is Role.PREFILL:
            runtime.async_engine.hooks.append(servicer.engine_hook)
        print(f"pdserve {role.value} worker {index} ready on {runtime.address}", flush=True)
    await runtime.wait_stopped()
    return runtime.exit_code


def run(config: PdserveConfig, role: Role, index: int) -> int:
    return asyncio.run(serve(config, role, index))
