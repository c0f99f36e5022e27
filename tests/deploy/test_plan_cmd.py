"""``pdserve plan``: a profile measured from a config's engine, then sized for a steady
load and for a trace, as a user runs it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest
import yaml

from common.config_loader import load_config
from deploy.cli import main
from planner.profile_data import read_profile


@pytest.fixture(scope="module")
def profiled(model_factory, tmp_path_factory):
    """A config on the tiny model and its profile (a small grid: this is about the
    command, not the numbers)."""
    root = tmp_path_factory.mktemp("plan")
    config = root / "deploy.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model_factory("llama")),
        "engine": {"device": "cpu", "dtype": "float32", "num_blocks": 64, "max_num_seqs": 8,
                   "max_num_batched_tokens": 64, "max_model_len": 256},
        "router": {"min_disagg_tokens": 32},
    }))  # fmt: skip
    profile = root / "profile.json"
    code = main(["plan", "profile", "--config", str(config), "--isl", "16,64,200",
                 "--batch", "1,4", "--context", "32,128", "--steps", "2",
                 "--out", str(profile)])  # fmt: skip
    assert code == 0
    return config, profile


def plan(*args: str) -> subprocess.CompletedProcess:
    """``pdserve plan ...`` in a fresh interpreter that then says whether torch was
    imported: sizing is arithmetic on a file and must not pay for it."""
    code = (
        "import sys\nfrom deploy.cli import main\n"
        f"code = main({list(args)!r})\n"
        "print('torch imported:', 'torch' in sys.modules)\nsys.exit(code)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_profile_holds_every_point_asked_for(profiled):
    _, path = profiled
    profile = read_profile(path)
    assert [p.isl for p in profile.prefill.prefill] == [16, 64, 200]
    assert sorted((p.context_tokens, p.batch) for p in profile.decode.decode) == [
        (32, 1), (32, 4), (128, 1), (128, 4)
    ]  # fmt: skip
    assert profile.prefill.engine.max_num_seqs == 8
    assert profile.prefill.engine.kv_capacity_tokens == 64 * 16


def test_size_a_steady_load_and_print_the_layout(profiled, tmp_path):
    config, profile = profiled
    out = tmp_path / "plan.json"
    done = plan("plan", "size", "--profile", str(profile), "--config", str(config),
                "--ttft-ms", "10000", "--itl-ms", "1000", "--rate", "2", "--isl", "150",
                "--osl", "20", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout
    assert "demand: 2.00 requests/s, 150 prompt tokens, 20 output tokens" in done.stdout
    assert "mean TTFT" in done.stdout and "mean ITL" in done.stdout
    record = json.loads(out.read_text())
    layout = record["layout"]
    assert f"--set prefill.replicas={layout['prefill']}" in done.stdout
    assert f"--set decode.replicas={layout['decode']}" in done.stdout
    assert f"--config {config}" in done.stdout
    (window,) = record["windows"]
    assert window["prefill"]["replicas"] == layout["prefill"] >= 1
    assert window["decode"]["context_tokens"] == pytest.approx(150 + 19 / 2)


def test_the_printed_up_line_runs_the_sized_layout(profiled):
    """The line dropped the ``--set`` values the sizing used (it ran another setup), and
    past 10 prefill workers their default ports ran into the decode workers' (it did not
    start; an audit): both are in the line now, and it loads."""
    config, profile = profiled
    done = plan("plan", "size", "--profile", str(profile), "--config", str(config),
                "--ttft-ms", "10000", "--itl-ms", "1000", "--rate", "400", "--isl", "200",
                "--osl", "4", "--set", "router.request_timeout_s=99")  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("  pdserve up"))
    words = shlex.split(line)
    overrides = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    prefill = int(next(o for o in overrides if o.startswith("prefill.replicas="))[17:])
    assert prefill > 10 and "router.request_timeout_s=99" in overrides
    assert any(o.startswith("decode.port=") for o in overrides)
    assert load_config(str(config), overrides).prefill.replicas == prefill  # it loads


def test_percentile_targets_are_sized_and_said(profiled, tmp_path):
    config, profile = profiled
    out = tmp_path / "plan.json"
    done = plan("plan", "size", "--profile", str(profile), "--config", str(config),
                "--ttft-ms", "10000", "--itl-ms", "1000", "--ttft-percentile", "99",
                "--itl-percentile", "90", "--rate", "2", "--isl", "150", "--osl", "20",
                "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "p99 TTFT" in done.stdout and "p90 ITL" in done.stdout
    targets = json.loads(out.read_text())["targets"]
    assert (targets["ttft_percentile"], targets["itl_percentile"]) == (99, 90)


def test_size_a_trace_window_by_window(profiled, tmp_path):
    config, profile = profiled
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 2048, "output_length": 200,
             "hash_ids": [0, 1, 2, 3 + i]} for i in range(40)]  # fmt: skip
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "plan.json"
    done = plan("plan", "size", "--profile", str(profile), "--config", str(config),
                "--ttft-ms", "10000", "--itl-ms", "1000", "--dataset", "mooncake",
                "--trace", str(trace), "--input-scale", "0.05", "--output-scale", "0.1",
                "--window", "1", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "4 windows of 1 s" in done.stdout
    record = json.loads(out.read_text())
    assert [w["num_requests"] for w in record["windows"]] == [10, 10, 10, 10]
    assert record["layout"]["decode"] == max(w["decode"]["replicas"] for w in record["windows"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--ttft-ms", "100", "--itl-ms", "10"), "give a steady load"),
        (("--ttft-ms", "0", "--itl-ms", "10", "--rate", "1", "--isl", "10", "--osl", "2"),
         "ttft_s target must be"),
        (("--ttft-ms", "100", "--itl-ms", "10", "--rate", "1", "--isl", "10", "--osl", "2",
          "--cached-tokens", "10"), "--cached-tokens must be in [0, --isl 10), got 10"),
        (("--ttft-ms", "100", "--itl-ms", "10", "--rate", "1", "--isl", "10", "--osl", "2",
          "--cached-tokens", "-1"), "--cached-tokens must be in [0, --isl 10), got -1"),
        (("--ttft-ms", "100", "--itl-ms", "10", "--rate", "1", "--isl", "10", "--osl", "2",
          "--dataset", "azure"), "one of them"),
        (("--ttft-ms", "100", "--itl-ms", "10", "--rate", "1", "--isl", "250", "--osl", "10"),
         "exceed the profiled max_model_len (256)"),
        (("--ttft-ms", "100", "--itl-ms", "10", "--rate", "1", "--isl", "10", "--osl", "2",
          "--itl-percentile", "100"), "itl_percentile must be in (0, 100), got 100"),
    ],
)  # fmt: skip
def test_bad_sizing_input_is_an_error_not_a_traceback(profiled, args, message):
    _, profile = profiled
    done = plan("plan", "size", "--profile", str(profile), *args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_trace_that_is_not_one_is_named(profiled, tmp_path):
    _, profile = profiled
    trace = tmp_path / "t.jsonl"
    trace.write_text("not json\n")
    done = plan("plan", "size", "--profile", str(profile), "--ttft-ms", "100", "--itl-ms", "10",
                "--dataset", "mooncake", "--trace", str(trace))  # fmt: skip
    assert done.returncode == 2 and f"trace {trace} is not a mooncake trace" in done.stderr


def test_a_file_that_is_not_a_profile_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m"}))
    done = plan("plan", "size", "--profile", str(bad), "--ttft-ms", "1", "--itl-ms", "1",
                "--rate", "1", "--isl", "1", "--osl", "1")  # fmt: skip
    assert done.returncode == 2
    assert f"{bad} is not a pdserve profile" in done.stderr
    missing = plan("plan", "size", "--profile", str(tmp_path / "none.json"), "--ttft-ms", "1",
                   "--itl-ms", "1", "--rate", "1", "--isl", "1", "--osl", "1")  # fmt: skip
    assert missing.returncode == 2 and "cannot read profile" in missing.stderr


def test_a_config_other_than_the_profiled_one_is_warned(profiled):
    config, profile = profiled
    done = plan("plan", "size", "--profile", str(profile), "--config", str(config),
                "--set", "decode.engine.max_num_seqs=16", "--set", "engine.max_model_len=96",
                "--ttft-ms", "1000", "--itl-ms", "100", "--rate", "1", "--isl", "50",
                "--osl", "10")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "warning: decode.engine.max_num_seqs is 16 here but 8 in the profile" in done.stderr
    assert "warning: prefill.engine.max_model_len is 96 here but" in done.stderr


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_predict_a_given_layout(profiled, tmp_path):
    """``--layout P,D``: what that layout sees, and where it misses; a load the sizing
    needs more workers for misses on one worker each."""
    config, profile = profiled
    args = ["plan", "size", "--profile", str(profile), "--config", str(config), "--ttft-ms",
            "10000", "--itl-ms", "1000", "--isl", "150", "--osl", "20"]  # fmt: skip
    sizing = plan(*args, "--rate", "400", "--out", str(tmp_path / "sized.json"))
    assert sizing.returncode == 0, sizing.stderr
    sized = json.loads((tmp_path / "sized.json").read_text())
    assert sized["layout"]["prefill"] > 1
    done = plan(*args, "--rate", "400", "--layout", "1,1", "--out", str(tmp_path / "1p1d.json"))
    assert done.returncode == 0, done.stderr
    assert "(misses: prompt throughput)" in done.stdout
    # An overloaded role's infinite TTFT is null in the record (it was Infinity: not JSON).
    strict = json.loads((tmp_path / "1p1d.json").read_text(), parse_constant=_not_json)
    assert strict["windows"][0]["prefill"]["ttft_s"] is None
    assert "layout: 1 prefill + 1 decode misses a target in 1 of 1 window" in done.stdout
    fits = plan(*args, "--rate", "400", "--layout",
                f"{sized['layout']['prefill']},{sized['layout']['decode']}")  # fmt: skip
    assert "misses a target in 0 of 1 window" in fits.stdout
    bad = plan(*args, "--rate", "1", "--layout", "1,0")
    assert bad.returncode == 2 and "expected PREFILL,DECODE workers" in bad.stderr


def test_an_out_path_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    """``plan profile`` measured for minutes, then failed to write and lost it all."""
    for out, message in ((tmp_path / "gone" / "p.json", "does not exist"),
                         (tmp_path, "is a directory")):  # fmt: skip
        started = time.monotonic()
        done = plan("plan", "profile", "--out", str(out))
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and time.monotonic() - started < 30
