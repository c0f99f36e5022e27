"""A decode engine whose pull from a frozen prefill worker runs past its deadline, over a
real NIXL connector (UCX over TCP, as between hosts without RDMA) and ``ConnectorPuller``.

UCX cannot cancel the pull's READ: once the frozen worker (a SIGSTOPped process) resumes,
its answer lands in the pull's blocks. The request must not wait for that: it fails over
at its deadline (recomputes, fails, or is gone if it was aborted), while the blocks stay
quarantined, allocated to no request, until the READ has ended; then they return to the
free pool and nothing leaks. Before, the request (and its client) waited for the resume.
"""

from __future__ import annotations

import signal
import time

import pytest

from common.engine_config import EngineConfig
from common.intmath import cdiv
from engine import LLMEngine, SamplingParams
from engine.request import RemoteKV
from kv_transfer import KVTransferConfig, PeerRef, create_connector
from tests.engine.helpers import random_prompts
from tests.kv_transfer.harness import start_peers
from worker.connector_puller import ConnectorPuller

TIMEOUT_S = 2.0
PROMPT_TOKENS = 40
ENGINE_CONFIG = EngineConfig(num_blocks=32, max_model_len=128)


def step_until(engine: LLMEngine, done, wait_s: float, what: str) -> list:
    """Step ``engine`` until ``done()``; its outputs. Fails after ``wait_s``."""
    outputs = []
    deadline = time.monotonic() + wait_s
    while not done():
        assert time.monotonic() < deadline, what
        outputs += engine.step()
        time.sleep(0.005)
    return outputs


def used_block_ids(engine: LLMEngine) -> set[int]:
    return {b for ids in engine.scheduler.kv.req_to_block_ids.values() for b in ids}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["recompute", "fail", "abort"])
def test_a_pull_from_a_frozen_peer_fails_over_at_its_deadline_and_quarantines_its_blocks(
    policy, tiny_llama, monkeypatch
):
    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: the exporter inherits it
    config = {"connector": "nixl", "timeout_s": TIMEOUT_S}
    engine = LLMEngine(
        tiny_llama, ENGINE_CONFIG, recompute_on_pull_failure=policy != "fail",
        kv_puller=None,
    )  # fmt: skip
    kv = engine.runner.kv_caches
    layout = {
        "num_layers": len(kv), "num_blocks": 64, "block_size": kv[0].shape[2],
        "num_kv_heads": kv[0].shape[3], "head_dim": kv[0].shape[4],
        "dtype": str(kv[0].dtype).removeprefix("torch."), "block_major": True,
    }  # fmt: skip
    (exporter,) = start_peers("frozen-prefill")
    metadata = exporter.call(
        "create", slot="src", engine_id="frozen", config=config, layout=layout, seed=1
    )["metadata"]
    known = {"frozen": bytes.fromhex(metadata)}
    connector = create_connector(KVTransferConfig(**config), "decode", known.__getitem__)
    engine.kv_puller = ConnectorPuller(connector)
    connector.register_kv_caches(kv)
    num_pulled = cdiv(PROMPT_TOKENS, ENGINE_CONFIG.block_size)
    warm, doomed, *others = random_prompts((PROMPT_TOKENS,) * 10, seed=11)
    params = SamplingParams(max_tokens=4, temperature=0)
    frozen = False

    def add(request_id: str, prompt: list[int], remote_ids: list[int]) -> None:
        remote = RemoteKV(f"lease-{request_id}", PROMPT_TOKENS, tuple(remote_ids),
                          PeerRef("frozen", "frozen"))  # fmt: skip
        engine.add_request(request_id, prompt, params, remote_kv=remote, output_token_ids=[7])

    try:
        # Connected before the freeze, as a prefill worker that served pulls already.
        exporter.call("export", slot="src", transfer_id="lease-warm",
                      block_ids=[0, 1, 2], block_hashes=None)  # fmt: skip
        add("warm", warm, [0, 1, 2])
        step_until(engine, lambda: not engine.has_work(), 20, "the warm-up pull never ended")
        assert engine.num_pull_failures == 0 and engine.leak_report() == []

        exporter.call("export", slot="src", transfer_id="lease-doomed",
                      block_ids=[10, 11, 12], block_hashes=None)  # fmt: skip
        exporter.process.send_signal(signal.SIGSTOP)
        frozen = True
        started = time.monotonic()
        add("doomed", doomed, [10, 11, 12])
        engine.step()
        assert "doomed" in engine.scheduler.fetching
        pulled = set(engine.scheduler.kv.get_block_ids("doomed")[:num_pulled])
        if policy == "abort":
            assert engine.abort_request("doomed") is not None

        # At the deadline, the exporter still frozen: the request moves on at once ...
        outputs = step_until(
            engine, lambda: not engine.scheduler.fetching, TIMEOUT_S + 3,
            "the pull held its request past its deadline (until the peer resumes)",
        )  # fmt: skip
        assert time.monotonic() - started < TIMEOUT_S + 3
        assert connector.num_late_fetches == 1 and connector.num_late_reads_running >= 1
        if policy == "fail":
            (output,) = outputs
            assert output.finished and "lease-doomed" in output.error
        if policy != "abort":
            assert engine.num_pull_failures == 1
        # ... its blocks quarantined: counted, allocated to no one, reported as held.
        kv_manager = engine.scheduler.kv
        assert kv_manager.num_quarantined_blocks == num_pulled
        assert {b.block_id for b in kv_manager.quarantined["lease-doomed"]} == pulled
        assert any("quarantined" in problem for problem in engine.leak_report())
        for i, prompt in enumerate(others):  # local prompts: the cache fills up around them
            engine.add_request(f"local-{i}", prompt, params)
        outputs = []
        deadline = time.monotonic() + 30
        while engine.has_pulls_or_requests():
            assert time.monotonic() < deadline, "requests never ended"
            outputs += engine.step()
            assert not used_block_ids(engine) & pulled, "a quarantined block was allocated"
        if policy == "recompute":  # the doomed request recomputed its prompt meanwhile
            finished = [o for o in outputs if o.request_id == "doomed" and o.finished]
            assert finished and finished[0].error is None
        assert kv_manager.num_quarantined_blocks == num_pulled
        assert engine.has_work()  # polling for the release

        exporter.process.send_signal(signal.SIGCONT)
        frozen = False
        step_until(engine, lambda: not engine.has_work(), 15, "quarantine never released")
        assert kv_manager.num_quarantined_blocks == 0 and connector.num_late_fetches == 0
        assert connector.num_late_reads_running == 0
        assert engine.leak_report() == []
        assert kv_manager.num_free_blocks == kv_manager.pool.num_blocks
    finally:
        if frozen:
            exporter.process.send_signal(signal.SIGCONT)
        connector.close()
        exporter.close()
        engine.close()
