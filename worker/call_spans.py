"""One trace span per call a worker serves (``common/tracing.py``): the child of the
router's span, whose trace context comes in the call's gRPC metadata, ended however the
call ends, with what the engine measured of the request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc

from common.tracing import NO_SPAN, Attributes, Span, Tracer
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from worker.convert import timings_to_proto


@contextlib.contextmanager
def call_span(
    tracer: Tracer, name: str, context: grpc.aio.ServicerContext, request_id: str
) -> Iterator[Span]:
    """The span of the call ``context`` serves, as ``name``. A call cancelled (the
    caller gave up, the client left, or the request was aborted here by its id) is
    marked ``pdserve.cancelled``, not failed; invalid input is the caller's error, noted
    and not failed; one that raised otherwise is failed with its error. With tracing
    off, the gRPC context is not even read."""
    if not tracer.enabled:
        yield NO_SPAN
        return
    metadata = context.invocation_metadata() or ()
    span = tracer.start(name, metadata, attributes={"pdserve.request_id": request_id})
    try:
        yield span
    except (asyncio.CancelledError, GeneratorExit):
        span.set({"pdserve.cancelled": True})
        raise
    except grpc.aio.AbortError:  # ``context.abort``: its code says why
        if context.code() == grpc.StatusCode.CANCELLED:
            span.set({"pdserve.cancelled": True})
        else:
            span.fail(f"{context.code()}: {context.details()}")
        raise
    except InvalidRequestError as exc:  # the caller's error, as a 4xx is: not failed
        span.set({"pdserve.invalid_request": str(exc)})
        raise
    except BaseException as exc:
        span.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        span.end()


def output_attributes(output: RequestOutput) -> Attributes:
    """A finished request's tokens and stage times, as span attributes."""
    completion = output.outputs[0]
    timings = timings_to_proto(output.times)
    attributes = {
        "gen_ai.usage.input_tokens": len(output.prompt_token_ids),
        "gen_ai.usage.output_tokens": completion.num_tokens,
        "pdserve.cached_tokens": output.num_cached_tokens,
        "pdserve.queue_ms": timings.queue_ms,
        "pdserve.prefill_ms": timings.prefill_ms,
        "pdserve.transfer_ms": timings.transfer_ms,
        "pdserve.decode_ms": timings.decode_ms,
        "pdserve.blocks_pulled": output.num_remote_blocks_pulled,
    }
    if completion.finish_reason:
        attributes["pdserve.finish_reason"] = completion.finish_reason
    return attributes
