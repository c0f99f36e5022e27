"""The launcher's autoscaler: what it reads from the router, and how it moves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import Role
from common.config_base import ConfigError
from common.config_loader import load_config
from deploy.autoscale import Autoscaler, planned_replicas


def autoscaler(**planner: object) -> Autoscaler:
    overrides = ["planner.profile=/p.json", "planner.autoscale=true", "prefill.replicas=2",
                 "decode.replicas=3", "planner.scale_in_delay_s=10"]  # fmt: skip
    overrides += [f"planner.{k}={v}" for k, v in planner.items()]
    return Autoscaler(load_config(None, overrides))


def test_the_plan_is_read_from_the_router_metrics():
    text = (
        "# HELP pdserve:planned_replicas Workers the role needs\n"
        "# TYPE pdserve:planned_replicas gauge\n"
        'pdserve:planned_replicas{role="prefill"} 1.0\n'
        'pdserve:planned_replicas{role="decode"} 3.0\n'
        'pdserve:worker_available{worker="decode-0"} 1.0\n'
    )
    assert planned_replicas(text) == {Role.PREFILL: 1, Role.DECODE: 3}
    assert planned_replicas("vllm:num_requests_running 0.0\n") == {}


def test_up_at_once_within_the_bounds():
    scaler = autoscaler(min_prefill_replicas=1)
    assert scaler.initial(Role.PREFILL) == 1 and scaler.initial(Role.DECODE) == 1
    assert scaler.target(Role.DECODE, 2, running=1, now=0.0) == 2
    assert scaler.target(Role.DECODE, 9, running=1, now=0.0) == 3  # replicas is the most
    assert scaler.target(Role.PREFILL, 0, running=0, now=0.0) == 1  # the minimum
    assert scaler.target(Role.DECODE, None, running=0, now=0.0) == 1  # no plan: bounds only
    assert scaler.target(Role.DECODE, None, running=2, now=0.0) == 2


def test_down_one_at_a_time_after_the_lower_plan_held():
    scaler = autoscaler()
    assert scaler.target(Role.DECODE, 1, running=3, now=100.0) == 3
    assert scaler.target(Role.DECODE, 1, running=3, now=109.0) == 3
    assert scaler.target(Role.DECODE, 1, running=3, now=110.0) == 2  # held 10 s: one drains
    assert scaler.target(Role.DECODE, 1, running=2, now=111.0) == 2  # the delay starts over
    assert scaler.target(Role.DECODE, 1, running=2, now=121.0) == 1


def test_a_plan_back_up_resets_the_delay():
    scaler = autoscaler()
    assert scaler.target(Role.DECODE, 1, running=2, now=0.0) == 2
    assert scaler.target(Role.DECODE, 2, running=2, now=5.0) == 2  # the burst is back
    assert scaler.target(Role.DECODE, 1, running=2, now=12.0) == 2  # counted from 12 s now
    assert scaler.target(Role.DECODE, 1, running=2, now=22.0) == 1


def test_config_check_and_deploy_say_what_the_planner_does():
    from deploy.config_cmd import summary
    from deploy.deploy_cmd import planner_warnings

    config = load_config(None, ["planner.profile=/p.json", "planner.autoscale=true",
                                "decode.replicas=3", "planner.ttft_ms=800"])  # fmt: skip
    lines = summary(config, None)
    assert lines[0] == "layout    1P3D, autoscaled from 0P1D to follow the router's plan"
    assert any(line.startswith("planner   /p.json: mean TTFT 800 ms, mean ITL 50 ms")
               for line in lines)  # fmt: skip
    tail = load_config(None, ["planner.profile=/p.json", "planner.ttft_percentile=90",
                              "planner.itl_percentile=99.5"])  # fmt: skip
    assert any(line.startswith("planner   /p.json: p90 TTFT 1000 ms, p99.5 ITL 50 ms")
               for line in summary(tail, None))  # fmt: skip
    with pytest.raises(ConfigError, match="planner.ttft_percentile"):
        load_config(None, ["planner.profile=/p.json", "planner.ttft_percentile=100"])
    assert "overlays/autoscale scales the roles with KEDA" in planner_warnings(config, "k8s")[0]
    assert "compose runs every replica" in planner_warnings(config, "compose")[0]
    assert planner_warnings(load_config(None, []), "k8s") == []
    with pytest.raises(ConfigError, match="planner.autoscale: needs planner.profile"):
        load_config(None, ["planner.autoscale=true"])
    with pytest.raises(ConfigError, match="planner.min_prefill_replicas: 2 is above"):
        load_config(None, ["planner.profile=/p", "planner.autoscale=true",
                           "planner.min_prefill_replicas=2"])  # fmt: skip


def test_up_refuses_a_profile_it_cannot_read_before_starting_anything(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "up", "--set", f"planner.profile={tmp_path}/no.json"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PDSERVE_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert done.returncode == 2
    assert "error: planner.profile: cannot read profile" in done.stderr
    assert not (tmp_path / "home").exists()  # no demo model made, no logs
