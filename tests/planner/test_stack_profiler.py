"""A running stack profiled through its router: the points asked for, the KV pools its
workers report, prompts the router keeps on the decode worker skipped, and each worker's
engine steps and busy time in the router's metrics."""

from __future__ import annotations

import asyncio

import pytest

from common.config_loader import load_config
from deploy.cli import main
from planner.grid import Grid
from planner.stack_profiler import profile_stack
from tests.support.polling import eventually
from tests.support.processes import write_config
from tests.support.stack import metric, serving, worker_stats


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack_profile")
    path = write_config(tmp / "deploy.yaml", model_factory("llama"),
                        engine={"kv_cache_bytes": 16 << 20, "max_model_len": 512,
                                "max_num_seqs": 8},
                        router={"min_disagg_tokens": 32})  # fmt: skip
    with serving(path, tmp / "home") as stack:
        yield stack


def test_the_stack_is_measured_as_a_client_sees_it(stack):
    config = load_config(str(stack.config_path))
    lines: list[str] = []
    grid = Grid(isls=(16, 64), batches=(1, 4), contexts=(96,), measured_steps=4, repeats=2)
    profile = asyncio.run(profile_stack(f"{stack.base_url}/v1", config, grid, lines.append))

    assert [p.isl for p in profile.prefill.prefill] == [64]
    assert any("prefill 16: skipped, below router.min_disagg_tokens (32)" in x for x in lines)
    assert sorted((p.context_tokens, p.batch) for p in profile.decode.decode) == [(96, 1), (96, 4)]
    assert all(p.latency_s > 0 and p.tokens_per_s > 0 for p in profile.prefill.prefill)
    assert all(p.itl_s > 0 for p in profile.decode.decode)
    for role, facts in (("prefill", profile.prefill.engine), ("decode", profile.decode.engine)):
        (stats,) = worker_stats(stack, role)
        assert facts.kv_capacity_tokens == stats.kv_blocks_total * 16
        assert (facts.max_model_len, facts.max_num_seqs) == (512, 8)
        assert stats.engine_steps > 0 and stats.engine_busy_seconds > 0  # its own account
    # and what the router's metrics show of it (its Stats are polled every second or so:
    # a CI run read 0 right after the profile, under load)
    assert eventually(lambda: metric(stack, "pdserve:worker_engine_steps") > 0)
    assert eventually(lambda: metric(stack, "pdserve:worker_engine_busy_seconds") > 0)
    assert "the stack at" in profile.machine


def test_a_stack_that_is_not_running_is_an_error(stack, tmp_path):
    code = main(["plan", "profile", "--config", str(stack.config_path), "--base-url",
                 "http://127.0.0.1:9/v1", "--out", str(tmp_path / "p.json")])  # fmt: skip
    assert code == 2
    assert not (tmp_path / "p.json").exists()
