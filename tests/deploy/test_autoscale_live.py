"""``pdserve up`` with ``planner.autoscale``: a burst makes the router's plan ask for a
second decode worker, which the launcher starts; once the burst is out of the plan's
window, the launcher drains it again. Nothing fails on the way."""

from __future__ import annotations

import time

from planner.profile_data import (
    DecodePoint,
    EngineFacts,
    PrefillPoint,
    Profile,
    RoleProfile,
    write_profile,
)
from tests.support.polling import eventually
from tests.support.processes import write_config
from tests.support.stack import metric, serving


def slow_decode_profile() -> Profile:
    """Prompts are free; a decode worker makes 20 tokens a second at any batch (a step of
    b requests takes 50 b ms), so it is planned for 17 (85%)."""
    facts = EngineFacts(16, 64, 2048, 1 << 20, 1024, 1, "float32", "cpu")
    prefill = [PrefillPoint(isl, 1e-4, 1e6) for isl in (16, 1024)]
    decode = [DecodePoint(b, c, 0.05 * b) for b in (1, 2, 4, 8) for c in (16, 1024)]
    return Profile("m", "cpu", "now", RoleProfile(facts, prefill=prefill),
                   RoleProfile(facts, decode=decode))  # fmt: skip


def test_a_burst_starts_a_decode_worker_and_the_quiet_after_it_drains_it(model_factory, tmp_path):
    profile = tmp_path / "profile.json"
    write_profile(slow_decode_profile(), profile)
    config = write_config(
        tmp_path / "deploy.yaml", model_factory("llama"), num_prefill=0, num_decode=2,
        planner={"profile": str(profile), "autoscale": True, "window_s": 15.0,
                 "interval_s": 0.5, "scale_in_delay_s": 2.0, "itl_ms": 10_000,
                 "correct": False},  # the crafted profile is the plan: no correction
    )  # fmt: skip
    with serving(config, tmp_path / "home") as stack:
        assert "decode-1" not in stack.children()  # the minimum: one decode worker
        assert metric(stack, "pdserve:worker_available") == 1
        client = stack.openai_client()
        model = client.models.list().data[0].id
        # 20 requests of 15 decode tokens in the 15 s window: 20 tokens/s, over one
        # worker's 17. (The window outlasts a worker's start: the plan holds meanwhile.)
        for _ in range(20):
            reply = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=16,
                                              extra_body={"ignore_eos": True})  # fmt: skip
            assert reply.usage.completion_tokens == 16
            time.sleep(0.2)
        assert eventually(lambda: "decode workers 1 -> 2: started decode-1" in stack.log(), 30)
        assert eventually(lambda: metric(stack, "pdserve:worker_available") == 2, 60)
        assert metric(stack, "pdserve:planned_replicas", role="decode") >= 2  # (capped at 2)
        # Quiet: the window empties, the lower plan holds 2 s, decode-1 drains and exits.
        assert eventually(lambda: "decode workers 2 -> 1: draining decode-1" in stack.log(), 30)
        assert eventually(lambda: "decode-1" not in stack.children(), 60)
        assert eventually(lambda: metric(stack, "pdserve:worker_available") == 1, 30)
        assert eventually(lambda: "decode-1 exited (0)" in stack.log(), 10)
        assert "restarting decode-1" not in stack.log()
        # Still serving, on decode-0.
        reply = client.completions.create(model=model, prompt=[5, 6], max_tokens=4)
        assert reply.choices[0].finish_reason in ("length", "stop")
