"""The engine over a real connector (shared storage) through ``ConnectorPuller``: an
aborted request gives its pull up, so its blocks come back at once."""

from __future__ import annotations

import time

from common.config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.request import RemoteKV
from kv_transfer import KVTransferConfig, PeerRef, create_connector
from tests.engine.helpers import random_prompts
from worker.connector_puller import ConnectorPuller


def test_an_aborted_request_gives_its_pull_up(tiny_llama, tmp_path):
    """The prompt's files never come (the prefill worker released its export unwritten):
    aborting the request (its client left) frees its blocks within a step or two, not
    at the pull's 30 s timeout; until then they stay reserved, as every pull's are."""
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path),
                              timeout_s=30.0)  # fmt: skip
    connector = create_connector(config, "decode-engine")
    engine = LLMEngine(tiny_llama, EngineConfig(), kv_puller=ConnectorPuller(connector))
    connector.register_kv_caches(engine.runner.kv_caches)
    with connector:
        prompt = random_prompts((40,), seed=3)[0]
        remote = RemoteKV("lease-gone", len(prompt), (4, 5, 6), PeerRef("prefill", "unused"))
        engine.add_request("r", prompt, SamplingParams(max_tokens=4), remote_kv=remote,
                           output_token_ids=[7])  # fmt: skip
        engine.step()
        assert "r" in engine.scheduler.fetching and connector.num_active_fetches == 1
        engine.step()
        started = time.monotonic()
        output = engine.abort_request("r")
        assert output is not None and output.finished
        assert engine.leak_report() != []  # the pull may still write: blocks reserved
        while engine.has_work():
            assert time.monotonic() - started < 3, "the pull was not given up"
            engine.step()
            time.sleep(0.01)
        assert engine.leak_report() == [] and connector.num_active_fetches == 0
        assert engine.num_pull_failures == 0  # given up, not failed
