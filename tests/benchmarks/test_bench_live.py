"""``pdserve bench`` against a real ``pdserve up`` stack (router + 1 prefill + 1 decode,
the tiny model): a sweep produces a valid report and plots, its timings agree with the
router's own, and multi-turn sessions resend their real history."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks.loadgen.arrivals import LoadSpec
from benchmarks.loadgen.bench import BenchConfig, run_benchmark
from benchmarks.loadgen.spec import DatasetSpec
from tests.support.processes import ROOT, write_config
from tests.support.stack import start_up_stack

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stack(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    # min_disagg_tokens=0: every request takes the prefill -> decode path.
    config = write_config(tmp / "config.yaml", tiny_llama, router={"min_disagg_tokens": 0})
    stack = start_up_stack(config, tmp / "home")
    children = stack.children()
    yield stack
    assert stack.stop() == 0, stack.log()
    for name, pid in children.items():
        assert not _alive(pid), f"{name} (pid {pid}) outlived pdserve up"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def router_histogram(base_url: str, name: str) -> tuple[float, float]:
    """(count, sum) of one of the router's Prometheus histograms."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for suffix in ("_count", "_sum"):
            if line.startswith(f"{name}{suffix}"):
                values[suffix] = float(line.rsplit(" ", 1)[1])
    return values["_count"], values["_sum"]


def test_sweep_report_and_plots(stack, tmp_path):
    ttft_before = router_histogram(stack.base_url, "vllm:time_to_first_token_seconds")
    e2e_before = router_histogram(stack.base_url, "vllm:e2e_request_latency_seconds")
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "deploy.cli", "bench", "--base-url", stack.base_url,
        "--dataset", "random", "--num-requests", "8", "--input-len", "48", "--range-ratio",
        "0.5", "--output-len", "6", "--rates", "8,inf", "--slo", "ttft=5000,tpot=1000",
        "--warmup", "0", "--out", str(out), "--name", "live", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| rate=8 |" in done.stdout and "| rate=inf |" in done.stdout

    report = json.loads((out / "live.json").read_text())
    served = {"model": Path(stack.config["model"]).name, "max_model_len": 1024}
    assert {k: report["server"][k] for k in served} == served
    assert [run["label"] for run in report["runs"]] == ["rate=8", "rate=inf"]
    assert report["runs"][1]["load"]["rate"] == "inf"
    client_ttft_s = client_e2e_s = 0.0
    for run in report["runs"]:
        summary, requests = run["summary"], run["requests"]
        assert summary["completed"] == summary["num_requests"] == len(requests) == 8
        assert summary["failed"] == summary["wrong_length"] == run["not_sent"] == 0
        assert summary["good_requests"] == 8
        assert summary["goodput"] == pytest.approx(summary["request_throughput"])
        # range_ratio 0.5: outputs of 3..9 tokens, each exactly as requested.
        assert summary["output_tokens"] == sum(r["expected_output_tokens"] for r in requests)
        assert summary["itl_ms"]["count"] == summary["output_tokens"] - 8
        assert summary["tpot_ms"]["count"] == 8
        for request in requests:
            assert request["error"] is None and request["exact_counts"]
            assert request["output_tokens"] == sum(request["chunk_tokens"])
            assert request["output_tokens"] == request["expected_output_tokens"]
            times = request["chunk_times_ms"]
            assert times == sorted(times) and times[0] == request["ttft_ms"]
            assert request["start_ms"] + times[-1] <= request["end_ms"]
            client_ttft_s += request["ttft_ms"] / 1000
            client_e2e_s += (request["end_ms"] - request["start_ms"]) / 1000
        ttft = summary["ttft_ms"]
        assert ttft["min"] <= ttft["median"] <= ttft["p90"] <= ttft["p99"] <= ttft["max"]
        window = max(r["end_ms"] for r in requests) - min(r["start_ms"] for r in requests)
        assert summary["duration_s"] == pytest.approx(window / 1000, abs=1e-5)
    # The router saw the same 16 requests, and each one took it no longer than the client.
    ttft_after = router_histogram(stack.base_url, "vllm:time_to_first_token_seconds")
    e2e_after = router_histogram(stack.base_url, "vllm:e2e_request_latency_seconds")
    assert ttft_after[0] - ttft_before[0] == 16 and e2e_after[0] - e2e_before[0] == 16
    assert 0 < ttft_after[1] - ttft_before[1] <= client_ttft_s
    assert 0 < e2e_after[1] - e2e_before[1] <= client_e2e_s

    for name in ("live_cdf.png", "live_sweep.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    markdown = (out / "live.md").read_text()
    assert "![live_cdf](live_cdf.png)" in markdown and "| rate=8 |" in markdown


def test_multi_turn_resends_the_generated_history(stack):
    spec = DatasetSpec("multi-turn", num_requests=6, turns=3, input_len=20, output_len=5)
    config = BenchConfig(f"{stack.base_url}/v1", spec, (LoadSpec(concurrency=2),),
                         warmup_requests=1, progress=False, seed=11)  # fmt: skip
    report = asyncio.run(run_benchmark(config))
    results = report.runs[0].results
    assert report.runs[0].summary.completed == 6 and len(results) == 6
    by_turn = {(r.session_id, r.turn): r for r in results}
    for (session, turn), result in by_turn.items():
        assert len(result.output_token_ids) == result.output_tokens == 5
        if turn:
            previous = by_turn[(session, turn - 1)]
            assert result.prompt_tokens == previous.prompt_tokens + 5 + 20
            assert result.start_s >= previous.end_s  # sent only after the previous reply


def test_duration_bound_stops_sending(stack):
    spec = DatasetSpec("random", num_requests=1000, input_len=16, output_len=2)
    config = BenchConfig(stack.base_url, spec, (LoadSpec(rate=20, duration_s=1.0),),
                         warmup_requests=0, progress=False)  # fmt: skip
    run = asyncio.run(run_benchmark(config)).runs[0]
    assert 5 <= len(run.results) <= 60 and run.not_sent == 1000 - len(run.results)
    # Nothing sent after the bound (at 20/s the rest would take 50 s); the slack is a
    # loaded box's event-loop lag (a CI run beside other work sent one at 1.2 s).
    assert all(r.start_s < 1.0 + 1.0 for r in run.results)
    assert not math.isnan(run.summary.request_throughput)
