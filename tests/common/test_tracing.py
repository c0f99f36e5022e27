"""Tracing (``common/tracing.py``): off, nothing is imported or recorded; on, spans reach a
real OTLP/HTTP receiver with the trace context they were given and pass it on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping

import pytest

from common.config import TracingConfig
from common.config_base import ConfigError
from common.config_loader import load_config
from common.tracing import NO_SPAN, Tracer, check_installed
from tests.support.otlp_receiver import otlp_receiver
from tests.support.processes import ROOT


def test_off_records_nothing_and_never_loads_the_sdk():
    """Off, the SDK and its exporter are never imported (FastAPI imports OpenTelemetry's
    API where it is installed, with no exporter behind it)."""
    code = (
        "import sys\n"
        "from common.config import TracingConfig\n"
        "from common.tracing import Tracer, NO_SPAN\n"
        "import router.app, worker.call_spans\n"
        "tracer = Tracer(TracingConfig(), 'pdserve-test')\n"
        "span = tracer.start('x', {'traceparent': '00-' + 'a' * 32 + '-' + 'b' * 16 + '-01'})\n"
        "span.set({'k': 1}); span.fail('no'); span.end(); tracer.shutdown()\n"
        "assert span is NO_SPAN and span.headers == () and not tracer.enabled\n"
        "loaded = ('opentelemetry.sdk', 'opentelemetry.exporter')\n"
        "print(sorted(m for m in sys.modules if m.startswith(loaded)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_spans_are_children_of_the_context_they_get_and_pass_their_own_on():
    with otlp_receiver() as receiver:
        tracer = Tracer(TracingConfig(receiver.url), "pdserve-test")
        trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
        incoming = [("traceparent", f"00-{trace_id}-{parent_id}-01"), ("other", "x")]
        span = tracer.start("POST /v1/completions", incoming, attributes={"a": 1})
        (name, value), *_ = span.headers
        assert name == "traceparent" and value.split("-")[1] == trace_id
        child = tracer.start("decode", span.headers, attributes={"b": "two"})
        child.fail("worker exploded")
        child.end()
        span.set({"c": 2.5, "d": True})
        span.end()
        span.end()  # a second end is a no-op, whichever path gets there first
        root = tracer.start("embed", None, server=False)  # no context: a trace of its own
        root.end()
        tracer.shutdown()  # sends what is buffered
        spans = {s.name: s for s in receiver.wait_for(lambda spans: len(spans) == 3, 5)}
    outer, inner, alone = spans["POST /v1/completions"], spans["decode"], spans["embed"]
    assert {s.service for s in spans.values()} == {"pdserve-test"}
    assert (outer.trace_id, outer.parent_span_id) == (trace_id, parent_id)
    assert value.split("-")[2] == outer.span_id  # what it passed on names it
    assert (inner.trace_id, inner.parent_span_id) == (trace_id, outer.span_id)
    assert outer.attributes == {"a": 1, "c": 2.5, "d": True} and not outer.failed
    assert inner.failed and inner.status_message == "worker exploded"
    assert (outer.kind, alone.kind) == (2, 3)  # server, client
    assert alone.trace_id != trace_id and alone.parent_span_id == ""


def test_sample_ratio_zero_records_new_traces_never_and_a_sampled_parents_always():
    with otlp_receiver() as receiver:
        tracer = Tracer(TracingConfig(receiver.url, sample_ratio=0.0), "pdserve-test")
        tracer.start("unsampled").end()
        sampled = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"
        tracer.start("sampled by its client", {"traceparent": sampled}).end()
        tracer.shutdown()
        spans = receiver.wait_for(lambda spans: len(spans) >= 1, 5)
    assert [s.name for s in spans] == ["sampled by its client"]


def test_a_collector_that_is_down_costs_spans_not_requests():
    """Spans are made and ended without waiting on the collector; a stopping process
    waits for it at most ``timeout_s``."""
    dead = "http://127.0.0.1:9/v1/traces"  # the discard port: nothing listens
    tracer = Tracer(TracingConfig(dead), "pdserve-test")
    started = time.monotonic()
    for _ in range(100):
        tracer.start("lost").end()
    assert time.monotonic() - started < 1.0
    time.sleep(1.5)  # an export is under way, retrying against nobody
    started = time.monotonic()
    tracer.shutdown(timeout_s=1.0)
    assert time.monotonic() - started < 1.5


def test_a_span_the_sdk_cannot_make_is_skipped_not_raised(caplog):
    class BrokenHeaders(Mapping):  # a headers object that fails when read
        def __getitem__(self, key):
            raise KeyError(key)

        def __iter__(self):
            raise RuntimeError("unreadable headers")

        def __len__(self):
            return 1

    with otlp_receiver() as receiver:
        tracer = Tracer(TracingConfig(receiver.url), "pdserve-test")
        span = tracer.start("POST /v1/completions", BrokenHeaders())
        span.set({"a": 1})
        span.end()
        tracer.shutdown()
    assert span is NO_SPAN and "could not start span" in caplog.text


def test_config_refuses_what_could_not_trace():
    with pytest.raises(ConfigError, match="tracing.otlp_traces_endpoint: 'collector:4318'"):
        load_config(None, ["tracing.otlp_traces_endpoint=collector:4318"])
    with pytest.raises(ConfigError, match="tracing.sample_ratio"):
        load_config(None, ["tracing.sample_ratio=1.5"])
    check_installed(TracingConfig())  # off: nothing needed
    assert Tracer(TracingConfig(), "pdserve-test").start("x") is NO_SPAN


def test_tracing_on_without_opentelemetry_stops_up_before_anything_starts(tmp_path):
    """A fresh process in which OpenTelemetry cannot be imported (as where it is not
    installed): ``pdserve up`` exits 2 naming the key and the extra to install, before
    making a model or starting a process; ``config check`` only warns (the image that
    runs the workers may have it)."""
    config = tmp_path / "c.yaml"
    config.write_text("tracing:\n  otlp_traces_endpoint: http://collector:4318/v1/traces\n")
    blocked = "import sys; sys.modules['opentelemetry'] = None; from deploy.cli import main; "
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path / "home")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        code = blocked + f"sys.exit(main({list(args)!r}))"
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    up = cli("up", "--config", str(config))
    assert up.returncode == 2, up.stderr
    assert "tracing.otlp_traces_endpoint" in up.stderr
    assert "pip install 'pdserve[tracing]'" in up.stderr
    assert not (tmp_path / "home").exists()  # no demo model made, nothing started
    check = cli("config", "check", str(config))
    assert check.returncode == 0 and "warning: tracing.otlp_traces_endpoint" in check.stderr
