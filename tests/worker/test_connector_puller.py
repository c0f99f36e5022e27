"""The engine over a real connector (shared storage) through ``ConnectorPuller``: an
aborted request gives its pull up, so its blocks come back at once; one aborted before
its pull releases the prefill worker's lease over gRPC."""

from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.engine_config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.request import RemoteKV
from kv_transfer import KVTransferConfig, PeerRef, create_connector
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.engine.helpers import random_prompts
from worker.connector_puller import ConnectorPuller
from worker.peer_metadata import PeerMetadataClient


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


class _Releases(pb_grpc.PrefillServiceServicer):
    """A prefill service that only records the leases it is asked to release."""

    def __init__(self) -> None:
        self.released: queue.Queue[str] = queue.Queue()

    def ReleaseKV(self, request, context):
        self.released.put(request.lease_id)
        return pb.ReleaseKVResponse(released=True)


def test_a_request_aborted_before_its_pull_releases_the_lease_at_the_prefill_worker(
    tiny_llama, tmp_path
):
    """Aborted while waiting (its pull never ordered), a decode worker's request sends
    ReleaseKV for its lease to the prefill worker named in its handle: nothing will read
    those blocks, and the router leaves such a lease to expire (it cannot tell whether a
    pull had started)."""
    servicer, server = _Releases(), grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = PeerMetadataClient(timeout_s=5.0)
    config = KVTransferConfig(connector="shared_storage", shared_dir=str(tmp_path))
    connector = create_connector(config, "decode-engine")
    puller = ConnectorPuller(connector, client.release_lease)
    engine = LLMEngine(tiny_llama, EngineConfig(), kv_puller=puller)
    connector.register_kv_caches(engine.runner.kv_caches)
    try:
        with connector:
            prompt = random_prompts((40,), seed=5)[0]
            peer = PeerRef("prefill", f"127.0.0.1:{port}")
            remote = RemoteKV("lease-unread", len(prompt), (4, 5, 6), peer)
            engine.add_request("r", prompt, SamplingParams(max_tokens=4), remote_kv=remote,
                               output_token_ids=[7])  # fmt: skip
            started = time.monotonic()
            assert engine.abort_request("r") is not None
            assert time.monotonic() - started < 0.5  # the engine thread never waits on it
            assert servicer.released.get(timeout=10) == "lease-unread"
            assert engine.leak_report() == []
    finally:
        client.close()
        server.stop(None)
