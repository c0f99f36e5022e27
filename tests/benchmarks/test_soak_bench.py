"""``benchmarks/soak.py`` against a real ``pdserve up`` stack (router + 1 prefill + 1 decode,
the tiny model): a short run of the whole mix gets the answers each kind of request should,
and its idle samples show the stack back at rest (no KV blocks, leases or sequences left)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import ROOT, write_config
from tests.support.stack import get_json, serving


def test_short_soak_answers_and_returns_to_idle(tiny_llama, tmp_path):
    # max_model_len 4096: the mix's longest prompts (600 words) fit.
    config = write_config(tmp_path / "config.yaml", tiny_llama, engine={"max_model_len": 4096})
    with serving(config, tmp_path / "home") as stack:
        _, models = get_json(f"{stack.base_url}/v1/models")
        model = models["data"][0]["id"]
        out = tmp_path / "soak.jsonl"
        ports = {role: stack.config[role]["port"] for role in ("prefill", "decode")}
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.soak", "--up-pid", str(stack.proc.pid),
             "--router", stack.base_url, "--prefill", f"127.0.0.1:{ports['prefill']}",
             "--decode", f"127.0.0.1:{ports['decode']}", "--model", model,
             "--concurrency", "3", "--load-s", "8", "--idle-s", "4", "--interval-s", "2",
             "--out", str(out)],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    outcomes = json.loads(done.stdout)
    assert not [kind for kind in outcomes if kind.startswith("error:")], outcomes
    expected = {"invalid": {"400", "404"}, "garbage": {"400"}}  # the rest: 200
    for name, status in (kind.split(":") for kind in outcomes if ":" in kind):
        assert status in expected.get(name, {"200"}), outcomes
    assert sum(n for kind, n in outcomes.items() if kind.endswith(":200")) > 0
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert {s["phase"] for s in samples} == {"load", "idle"}
    last = samples[-1]
    assert last["phase"] == "idle"
    for role in ("prefill", "decode"):
        assert last[role]["kv_blocks_used"] == 0
        assert last[role]["live_leases"] == 0
        assert last[role]["running"] == last[role]["waiting"] == 0
    assert last["router"]["vllm:num_requests_running"] == 0
    assert last["router"]["vllm:num_requests_waiting"] == 0
    roles = {name.split("-")[0] for name in last["processes"]}
    assert roles == {"up", "prefill", "decode", "router"}
