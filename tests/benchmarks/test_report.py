"""Reports and the command line without a server: a hand-built report renders to valid
JSON, Markdown and PNGs; bad flags and an unreachable server fail clearly."""

from __future__ import annotations

import json
import math

from benchmarks.loadgen.arrivals import LoadSpec
from benchmarks.loadgen.bench import BenchConfig, BenchReport, RunReport
from benchmarks.loadgen.client import RequestResult
from benchmarks.loadgen.metrics import SLO, summarize
from benchmarks.loadgen.report import report_dict, write_report
from benchmarks.loadgen.spec import DatasetSpec
from deploy.cli import main
from tests.support.processes import free_port_base


def hand_built_report() -> BenchReport:
    slo = SLO(ttft_ms=100, tpot_ms=20)
    config = BenchConfig("http://h:1/v1", DatasetSpec("random", num_requests=3),
                         (LoadSpec(rate=1.0), LoadSpec(rate=math.inf)), slo,
                         api_key="sk-secret")  # fmt: skip
    report = BenchReport(config, {"base_url": "http://h:1/v1", "model": "m",
                                  "max_model_len": 64})  # fmt: skip
    for index, load in enumerate(config.loads):
        results = []
        for i in range(3):
            start = i * 0.5
            result = RequestResult(i, 0, 8, 3, start, end_s=start + 0.2 + index * 0.1)
            result.ttft_s, result.chunk_times_s = 0.05 * (i + 1), [0.05 * (i + 1), 0.15, 0.19]
            result.chunk_tokens, result.output_tokens = [1, 1, 1], 3
            results.append(result)
        results.append(RequestResult(9, 0, 8, 3, 2.0, end_s=2.1, error="HTTP 429: busy"))
        report.runs.append(RunReport(load.label, load, index, summarize(results, slo), results,
                                     not_sent=0, server_prefix_hit_rate=0.25))  # fmt: skip
    return report


def test_report_files_are_valid_and_keep_no_secret(tmp_path):
    report = hand_built_report()
    paths = write_report(report, tmp_path, "hand", command="pdserve bench --rates 1,inf")
    assert [p.name for p in paths] == ["hand.json", "hand.md", "hand_cdf.png", "hand_sweep.png"]
    text = (tmp_path / "hand.json").read_text()
    assert "sk-secret" not in text
    body = json.loads(text)
    assert body == json.loads(json.dumps(report_dict(report) | {"command": body["command"]}))
    assert body["config"]["api_key"] == "***"
    assert [run["load"]["rate"] for run in body["runs"]] == [1.0, "inf"]
    first = body["runs"][0]
    assert first["summary"]["completed"] == 3 and first["summary"]["failed"] == 1
    assert first["requests"][3]["error"] == "HTTP 429: busy"
    assert first["requests"][0]["chunk_times_ms"] == [50.0, 150.0, 190.0]
    markdown = (tmp_path / "hand.md").read_text()
    assert "| rate=1 |" in markdown and "| rate=inf |" in markdown
    assert "1 failed" in markdown and "hit rate 25.0%" in markdown
    assert "ITL here is per token" in markdown  # (vLLM's bench: per chunk)
    assert "![hand_sweep](hand_sweep.png)" in markdown
    for png in paths[2:]:
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_bad_flags_and_a_missing_server_are_clear_errors(tmp_path, capsys):
    def bench(*args: str) -> tuple[int, str]:
        code = main(["bench", "--no-progress", *args])
        return code, capsys.readouterr().err

    code, err = bench("--rate", "1", "--rates", "1,2")
    assert code == 2 and "--rate or --rates" in err
    code, err = bench("--slo", "ttft")
    assert code == 2 and "bad SLO item" in err
    code, err = bench("--dataset", "random", "--replay")
    assert code == 2 and "trace dataset" in err
    # Flags one of which was ignored beside the other, without a word.
    for flags in (
        ("--concurrency", "4", "--rate", "2"),
        ("--concurrency", "4", "--max-concurrency", "8"),
    ):
        code, err = bench(*flags)
        assert code == 2 and "--concurrency is a closed loop" in err
    code, err = bench("--dataset", "azure", "--rate", "2", "--time-scale", "0.5")
    assert code == 2 and "--time-scale scales a trace's own times" in err
    port = free_port_base(1)
    code, err = bench("--base-url", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path))
    assert code == 1 and "error:" in err
    assert not list(tmp_path.iterdir())
