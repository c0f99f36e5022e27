"""A real OTLP/HTTP trace receiver on 127.0.0.1 (what a collector's :4318 does): it
decodes each ``ExportTraceServiceRequest`` with OpenTelemetry's own protobuf types and
keeps the spans, for tests to read."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    instance: str  # its service.instance.id
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict[str, object]
    failed: bool
    status_message: str
    start_ns: int
    end_ns: int


def _value(any_value) -> object:
    field = any_value.WhichOneof("value")
    return getattr(any_value, field) if field else None


class Receiver:
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        instance=str(resource.get("service.instance.id", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        failed=span.status.code == STATUS_ERROR,
                        status_message=span.status.message,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                    ))  # fmt: skip
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15.0
    ) -> list[ReceivedSpan]:
        """The spans once ``condition`` holds of them; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not condition(spans := self.spans()):
            assert time.monotonic() < deadline, f"spans never matched; got {spans}"
            time.sleep(0.1)
        return spans


@contextlib.contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver._thread.start()
    try:
        yield receiver
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()
