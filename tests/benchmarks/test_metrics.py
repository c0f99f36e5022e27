"""Metric definitions against hand-built request timelines (no server)."""

from __future__ import annotations

import contextlib

import pytest

from benchmarks.loadgen.client import RequestResult, chunk_token_count, finish_counts, record_chunk
from benchmarks.loadgen.metrics import SLO, Stats, itl_s, send_rate, summarize, tpot_s, window_s


def timeline(
    start: float,
    chunks: list[tuple[float, int]],
    end: float,
    prompt: int = 10,
    expected: int | None = None,
    error: str | None = None,
) -> RequestResult:
    """A finished request: ``chunks`` are (seconds after its start, tokens carried)."""
    tokens = sum(count for _, count in chunks)
    return RequestResult(
        session_id=0, turn=0, prompt_tokens=prompt,
        expected_output_tokens=tokens if expected is None else expected,
        start_s=start, end_s=end, ttft_s=chunks[0][0] if chunks else None,
        output_tokens=tokens, chunk_times_s=[t for t, _ in chunks],
        chunk_tokens=[c for _, c in chunks], error=error,
    )  # fmt: skip


def test_itl_spreads_multi_token_chunks_and_tpot_is_their_mean():
    # First chunk: 2 tokens at 100 ms; then 1 at 120 ms; 2 at 320 ms; 1 at 350 ms.
    r = timeline(0.0, [(0.100, 2), (0.120, 1), (0.320, 2), (0.350, 1)], end=0.360)
    assert itl_s(r) == pytest.approx([0.0, 0.020, 0.100, 0.100, 0.030])
    assert len(itl_s(r)) == r.output_tokens - 1
    assert sum(itl_s(r)) == pytest.approx(0.350 - 0.100)
    assert tpot_s(r) == pytest.approx(0.250 / 5)
    assert r.ttft_s == 0.100 and r.e2e_s == pytest.approx(0.360)


def test_one_token_request_has_no_tpot_and_no_itl():
    r = timeline(0.0, [(0.050, 1)], end=0.060)
    assert tpot_s(r) is None and itl_s(r) == []


def test_percentiles_interpolate_linearly():
    stats = Stats.of_seconds([0.010, 0.020, 0.030, 0.040, 0.050])
    assert stats.count == 5
    assert stats.mean == pytest.approx(30.0) and stats.median == pytest.approx(30.0)
    assert stats.p90 == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert stats.p99 == pytest.approx(49.6)
    assert (stats.min, stats.max) == (pytest.approx(10.0), pytest.approx(50.0))
    assert Stats.of_seconds([]) == Stats(0)


def test_goodput_counts_requests_meeting_every_slo_over_the_window():
    slo = SLO.parse("ttft=100, tpot=20")
    good = timeline(1.0, [(0.05, 1), (0.06, 1), (0.07, 1)], end=1.1)  # ttft 50, tpot 10
    slow_first = timeline(1.5, [(0.30, 1), (0.31, 1)], end=1.9)  # ttft 300 ms
    slow_decode = timeline(2.0, [(0.05, 1), (0.15, 1)], end=2.2)  # tpot 100 ms
    single = timeline(3.0, [(0.08, 1)], end=3.1)  # no tpot: meets it
    failed = timeline(4.0, [], end=5.0, expected=4, error="HTTP 500: boom")
    results = [good, slow_first, slow_decode, single, failed]
    assert [slo.met_by(r) for r in results] == [True, False, False, True, False]
    summary = summarize(results, slo)
    assert window_s(results) == pytest.approx(4.0)  # first start 1.0 .. last end 5.0
    assert summary.duration_s == pytest.approx(4.0)
    assert (summary.completed, summary.failed, summary.good_requests) == (4, 1, 2)
    assert summary.request_throughput == pytest.approx(4 / 4.0)
    assert summary.goodput == pytest.approx(2 / 4.0)
    assert summary.output_tokens == 3 + 2 + 2 + 1
    assert summary.output_token_throughput == pytest.approx(8 / 4.0)
    assert summary.total_token_throughput == pytest.approx((8 + 40) / 4.0)
    assert summary.ttft_ms.count == 4 and summary.tpot_ms.count == 3
    assert summary.itl_ms.count == 2 + 1 + 1
    assert summary.send_rate == pytest.approx(4 / 3.0)  # 5 sends over 1.0 .. 4.0


def test_a_subset_of_a_run_has_its_rates_over_the_runs_window():
    """A priority class summarized over its own window: two requests 0.1 s apart in a
    10 s run had 8.3 requests/s of goodput where the run had 1.2 (an audit)."""
    slo = SLO.parse("ttft=100")
    burst = [timeline(at, [(0.05, 1)], end=at + 0.1) for at in (0.0, 0.1)]
    rest = [timeline(float(at), [(0.05, 1)], end=at + 0.1) for at in range(1, 10)]
    run = burst + rest
    alone = summarize(burst, slo)
    shared = summarize(burst, slo, window_s(run))
    assert alone.goodput == pytest.approx(2 / 0.2)
    assert shared.goodput == pytest.approx(2 / window_s(run)) and shared.duration_s == 9.1
    parts = shared.goodput + summarize(rest, slo, window_s(run)).goodput
    assert parts == pytest.approx(summarize(run, slo).goodput)


def test_e2e_slo_and_no_slo():
    r = timeline(0.0, [(0.05, 1), (0.06, 1)], end=0.5)
    assert SLO(e2e_ms=400).met_by(r) is False and SLO(e2e_ms=600).met_by(r) is True
    summary = summarize([r], SLO())
    assert summary.goodput is None and summary.good_requests is None and summary.slo == "none"


def test_wrong_output_length_is_reported_not_hidden():
    short = timeline(0.0, [(0.05, 1), (0.06, 1)], end=0.1, expected=5)
    assert summarize([short], SLO()).wrong_length == 1
    # Fast because it stopped early: no SLO counts it good.
    assert SLO(e2e_ms=1000).met_by(short) is False
    assert summarize([short], SLO(e2e_ms=1000)).good_requests == 0


def test_estimated_counts_are_flagged_in_the_summary():
    r = timeline(0.0, [(0.05, 1), (0.06, 1)], end=0.1)
    assert summarize([r], SLO()).exact_counts
    r.exact_counts = False
    assert not summarize([r], SLO()).exact_counts


def test_a_stream_cut_before_done_is_a_failure():
    """A real socket: the server sends a token chunk, then closes without [DONE]."""
    import asyncio
    import json

    from benchmarks.loadgen.client import BenchClient

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        chunk = {"choices": [{"text": "a", "token_ids": [7]}]}
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        writer.write(head + f"data: {json.dumps(chunk)}\n\n".encode())
        await writer.drain()
        writer.close()

    async def scenario() -> RequestResult:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        result = RequestResult(0, 0, 3, 4, 0.0)
        async with server, BenchClient(f"http://127.0.0.1:{port}/v1", "m") as client:
            await client.send(result, [1, 2, 3], 0.0)
        return result

    result = asyncio.run(scenario())
    assert result.error == "the stream ended without [DONE]" and not result.ok


def test_the_timeout_bounds_the_whole_stream_not_each_read():
    """A server that keeps sending a token every 50 ms: httpx's timeout bounds each read
    alone, so a 0.3 s --timeout let it run on (a 1500-token stream took 6 s and passed)."""
    import asyncio
    import json
    import time

    from benchmarks.loadgen.client import BenchClient

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\n\r\n")  # fmt: skip
        chunk = {"choices": [{"text": "a", "token_ids": [7]}]}
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await writer.drain()
                await asyncio.sleep(0.05)
        writer.close()

    async def scenario() -> RequestResult:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        result = RequestResult(0, 0, 3, 100, 0.0)
        async with server, BenchClient(f"http://127.0.0.1:{port}/v1", "m", timeout_s=0.3) as c:
            await c.send(result, [1, 2, 3], 0.0)
        return result

    started = time.monotonic()
    result = asyncio.run(scenario())
    assert result.error == "timed out after 0.3 s (--timeout)" and not result.ok
    assert 0 < result.output_tokens < 100 and time.monotonic() - started < 3


@pytest.mark.parametrize("text", ["ttft", "ttft=0", "itl=5", "ttft=1,ttft=2", "ttft=abc"])
def test_bad_slo_is_refused(text):
    with pytest.raises(ValueError):
        SLO.parse(text)


def test_window_and_send_rate_of_nothing():
    assert window_s([]) == 0.0 and send_rate([]) == 0.0
    summary = summarize([], SLO(ttft_ms=1))
    assert summary.request_throughput == 0.0 and summary.goodput == 0.0


def test_token_counts_from_token_ids_then_logprobs_then_text():
    assert chunk_token_count({"text": "", "token_ids": [5]}) == (1, True)
    assert chunk_token_count({"text": "ab", "token_ids": [5, 6]}) == (2, True)
    assert chunk_token_count({"text": "ab", "logprobs": {"tokens": ["a", "b"]}}) == (2, True)
    assert chunk_token_count({"text": "ab"}) == (1, False)
    assert chunk_token_count({"text": ""}) == (0, False)


def test_usage_replaces_estimated_counts_but_not_exact_ones():
    estimated = RequestResult(0, 0, 4, 3, 0.0)
    usage = None
    for at, body in [(0.1, {"choices": [{"text": "a"}]}), (0.2, {"choices": [{"text": "bc"}]}),
                     (0.3, {"choices": [], "usage": {"completion_tokens": 3}})]:  # fmt: skip
        usage = record_chunk(estimated, body, at, usage)
    estimated.end_s = 0.3
    finish_counts(estimated, usage)
    assert estimated.output_tokens == 3 and not estimated.exact_counts
    assert estimated.ttft_s == 0.1 and estimated.chunk_tokens == [1, 1]

    exact = RequestResult(0, 0, 4, 3, 0.0)
    usage = record_chunk(exact, {"choices": [{"text": "", "token_ids": [1, 2]}]}, 0.1, None)
    usage = record_chunk(exact, {"choices": [], "usage": {"completion_tokens": 9}}, 0.2, usage)
    exact.end_s = 0.2
    finish_counts(exact, usage)
    assert exact.output_tokens == 2 and exact.output_token_ids == [1, 2] and exact.ok


def test_error_chunk_fails_the_request():
    result = RequestResult(0, 0, 4, 3, 0.0)
    record_chunk(result, {"error": {"message": "decode failed", "code": 503}}, 0.1, None)
    assert result.error == "decode failed" and not result.ok
