"""The decode servicer's reading of a KV handle: when its pull must start by."""

from __future__ import annotations

import time
import types

from common.config import CLOCK_SKEW_S, PdserveConfig, Role
from decode_service.servicer import DecodeServicer
from proto import pdserve_pb2 as pb


def _servicer() -> DecodeServicer:
    config = PdserveConfig()
    runtime = types.SimpleNamespace(config=config, role=Role.DECODE, model_namespace="m")
    return DecodeServicer(runtime)  # type: ignore[arg-type]


def _handle(**fields) -> pb.GenerateRequest:
    kv = pb.KVHandle(connector="nixl", block_ids=[0], num_tokens=4, lease_id="lease-1",
                     block_size=16, model_namespace="m", **fields)  # fmt: skip
    return pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3, 4], kv=kv)


def test_a_pull_starts_by_the_lease_the_router_measured_not_a_wall_clock():
    """Timed from the prefill worker's wall clock, a decode host 25 s behind pulled blocks
    its peer had freed and reused (wrong tokens, no error), and one ahead refused every
    pull. The router's ``lease_left_s`` (monotonic clocks) wins; a handle without it (a
    router or prefill worker from before) is read as before."""
    servicer = _servicer()
    timeout_s = PdserveConfig().kv_transfer.timeout_s
    far = time.time() + 3600  # a prefill host's wall clock an hour ahead
    before = time.monotonic()
    remote = servicer._remote_kv(_handle(lease_expires_at=far, lease_left_s=20.0))
    after = time.monotonic()
    assert remote is not None and remote.start_by is not None
    left = 20.0 - timeout_s - CLOCK_SKEW_S
    assert before + left <= remote.start_by <= after + left
    legacy = servicer._remote_kv(_handle(lease_expires_at=time.time() + 20.0))
    assert legacy is not None and abs(legacy.start_by - (time.monotonic() + left)) < 0.5
