"""The one place where worker exceptions become gRPC status codes."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from engine.async_engine import EngineFailedError
from engine.errors import InvalidRequestError, UnknownLoraAdapterError
from engine.outputs import RequestOutput
from proto import PARAM_KEY, REFUSED_KEY

logger = logging.getLogger(__name__)


class _CancelledWrites(logging.Filter):
    """gRPC's aio server logs an ERROR with a traceback ("ExecuteBatchError raised in core
    by servicer method") when a streaming handler's message is written after its client
    cancelled the call, a send that can only fail. The router cancels decode streams as
    routine (a client gone, a stop string, a migration): a 15-minute soak left 58 such
    tracebacks in the decode workers' logs, noise an operator reads as failures (an
    audit). They go out at DEBUG; any other error gRPC logs stays an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ == "ExecuteBatchError" and "SendMessageOperation" in str(error):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_cancelled_writes() -> None:
    """Install ``_CancelledWrites`` on gRPC's logger (once per process)."""
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _CancelledWrites) for f in grpc_log.filters):
        grpc_log.addFilter(_CancelledWrites())


class DrainingError(RuntimeError):
    """The worker takes no new requests: it drains, is still starting, or its engine
    failed (``reason``, said to the caller as ``proto.REFUSED_KEY``)."""

    def __init__(self, message: str, reason: str = "draining") -> None:
        super().__init__(message)
        self.reason = reason


class DisabledError(RuntimeError):
    """The call needs a feature this worker's config leaves off."""


class RequestFailedError(RuntimeError):
    """The request was admitted but could not be completed (e.g. its KV pull failed under
    failure_policy=fail)."""


def raise_for_error(output: RequestOutput) -> None:
    """Raise what a failed request's output means: invalid input where the error was the
    request's own fault (``error_param``), the worker's failure where its engine stopped,
    a failed request otherwise (its KV pull failed under failure_policy: fail)."""
    if output.error_param:
        raise InvalidRequestError(output.error or "invalid request", output.error_param)
    if output.engine_failed:
        raise EngineFailedError(output.error or "the engine stopped")
    if output.error:
        raise RequestFailedError(output.error)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, UnknownLoraAdapterError):  # (unloaded meanwhile: a 404, not a 400)
        return grpc.StatusCode.NOT_FOUND, exc.message
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, exc.message
    if isinstance(exc, DrainingError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DisabledError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, RequestFailedError):  # the request's failure, not the worker's:
        return grpc.StatusCode.ABORTED, str(exc)  # the router does not mark it down
    if isinstance(exc, EngineFailedError):  # this worker is out; the router tries another
        return grpc.StatusCode.UNAVAILABLE, f"engine failed: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _abort_details(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """Status code, message and trailing metadata for ``exc``, logged if unexpected. A
    refusal says so in its metadata (``proto.REFUSED_KEY``), invalid input names the field
    at fault (``proto.PARAM_KEY``)."""
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("%s failed", method)
    metadata: tuple = ()
    if isinstance(exc, DrainingError):
        metadata = ((REFUSED_KEY, exc.reason),)
    elif isinstance(exc, InvalidRequestError) and exc.param:
        metadata = ((PARAM_KEY, exc.param),)
    return code, message, metadata


def grpc_errors(method: Callable) -> Callable:
    """Decorate an async unary servicer method: map exceptions to status codes."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:
            await context.abort(*_abort_details(exc, method.__name__))

    return wrapper


def grpc_stream_errors(method: Callable) -> Callable:
    """Decorate an async server-streaming servicer method the same way."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            items = method(self, request, context)
            async with contextlib.aclosing(items):  # closed with this stream, not at GC
                async for item in items:
                    yield item
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:
            await context.abort(*_abort_details(exc, method.__name__))

    return wrapper
