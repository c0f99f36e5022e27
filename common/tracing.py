"""Request traces (OpenTelemetry, OTLP over HTTP), optional: the router opens a span per
HTTP request that runs, each worker a span per call it serves, and the W3C trace context
(``traceparent``) travels in gRPC metadata from the router to the workers, so that one
trace shows a request's prefill and decode (its KV pull's time on the decode span) across
processes. A client's own ``traceparent`` header makes the router's span its child.

Off by default (``tracing.otlp_traces_endpoint`` unset): then every span is one shared
no-op object and the SDK is never imported. On, spans are exported in batches from a
background thread. Tracing never fails a request: a span that cannot be made is skipped
(and logged), and a collector that is down loses spans, never requests."""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from common.config import TracingConfig
from common.config_base import ConfigError

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # what carries a trace context (W3C)
SHUTDOWN_S = 3.0  # how long a stopping process waits for its last spans to leave
EXPORT_DELAY_MS = 1000  # how long a finished span may wait to be sent with others

Attributes = Mapping[str, str | int | float | bool]


def check_installed(config: TracingConfig) -> None:
    """A ``ConfigError`` when tracing is on and OpenTelemetry's exporter is not
    installed here: every process that traces checks at start, not at its first span."""
    if config.otlp_traces_endpoint is None:
        return
    try:
        found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found or importlib.util.find_spec("opentelemetry.sdk") is None:
        raise ConfigError(
            "tracing.otlp_traces_endpoint",
            "tracing needs OpenTelemetry's SDK and OTLP/HTTP exporter, not installed here: "
            "pip install 'pdserve[tracing]' (or unset the endpoint)",
        )


class Span:
    """A span being recorded; this base class is the one used when tracing is off and
    records nothing. ``headers`` are the trace context to send with calls it makes;
    ``recording``: whether attributes are kept (callers skip computing them otherwise)."""

    headers: tuple[tuple[str, str], ...] = ()
    recording = False

    def set(self, attributes: Attributes) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN = Span()


class _OtelSpan(Span):
    recording = True

    def __init__(self, span: Any, headers: tuple[tuple[str, str], ...], status: Any) -> None:
        self._span = span
        self.headers = headers
        self._status = status  # opentelemetry.trace's (Status, StatusCode.ERROR)
        self._ended = False

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(dict(attributes))

    def fail(self, message: str) -> None:
        status, error = self._status
        self._span.set_status(status(error, message))

    def end(self) -> None:
        if not self._ended:  # ends once, whichever path gets there first
            self._ended = True
            self._span.end()


class Tracer:
    """Spans of one process (``service_name``: pdserve-router, pdserve-prefill, ...;
    ``instance_id``: which replica, as the registry names it, so that a trace says which
    of several prefill or decode workers served a call)."""

    def __init__(self, config: TracingConfig, service_name: str, instance_id: str = "") -> None:
        self._tracer = None
        self._provider = None
        if config.otlp_traces_endpoint is None:
            return
        check_installed(config)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._propagator = TraceContextTextMapPropagator()
        self._status = (Status, StatusCode.ERROR)
        self._in_context = set_span_in_context
        self._kinds = {True: SpanKind.SERVER, False: SpanKind.CLIENT}
        # A provider of its own, not the global one: nothing else in the process (a
        # library that traces itself) exports through ours by accident.
        self._provider = TracerProvider(
            resource=Resource.create(
                {"service.name": service_name, "service.instance.id": instance_id}
            ),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=config.otlp_traces_endpoint, timeout=5)
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("pdserve")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(
        self,
        name: str,
        parent: Iterable[tuple[str, str]] | Mapping[str, str] | None = None,
        *,
        server: bool = True,
        attributes: Attributes | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """A span named ``name``, the child of the trace context in ``parent`` (HTTP
        headers or gRPC metadata; none: a new trace). ``server``: the span serves a call
        (False: it makes one). ``start_ns``: when it began (``time.time_ns()``; None: now).
        Always ended by the caller, on every path. Never raises: a span the SDK cannot
        make is skipped and logged, as tracing must not fail the request it watches."""
        if self._tracer is None:
            return NO_SPAN
        try:
            items = parent.items() if isinstance(parent, Mapping) else parent or ()
            carrier = {k.lower(): v for k, v in items if k.lower() in TRACE_HEADERS}
            context = self._propagator.extract(carrier)
            span = self._tracer.start_span(name, context=context, kind=self._kinds[server],
                                           attributes=attributes, start_time=start_ns)  # fmt: skip
            sent: dict[str, str] = {}
            self._propagator.inject(sent, context=self._in_context(span))
        except Exception:
            logger.exception("could not start span %s; going on without it", name)
            return NO_SPAN
        return _OtelSpan(span, tuple(sent.items()), self._status)

    def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Send what is still buffered and stop exporting, waiting at most ``timeout_s``
        (the SDK's own shutdown waits up to 30 s on a collector that is down; what is
        left then is dropped with its daemon thread)."""
        if self._provider is not None:
            stopping = threading.Thread(target=self._provider.shutdown, daemon=True)
            stopping.start()
            stopping.join(timeout_s)
