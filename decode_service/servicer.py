"""DecodeService: continue a request from its first token, pulling the prompt's KV from the
prefill worker named in its KV handle (or prefilling locally when there is none), and
stream the tokens. A thin translator: proto → engine call → proto."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from common.config import CLOCK_SKEW_S
from engine.errors import InvalidRequestError
from engine.request import RemoteKV
from kv_transfer import PeerRef
from proto import ADMITTED_KEY
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker.call_spans import call_span, output_attributes
from worker.convert import (
    add_prompt_logprobs,
    images_from_proto,
    logprobs_to_proto,
    optional,
    sampling_from_proto,
    timings_to_proto,
    usage_to_proto,
)
from worker.grpc_errors import grpc_stream_errors, raise_for_error
from worker.runtime import WorkerRuntime
from worker.shared_rpcs import WorkerRPCs

logger = logging.getLogger(__name__)


class DecodeServicer(WorkerRPCs, pb_grpc.DecodeServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.num_active = 0
        self.num_blocks_pulled = 0
        self._mismatches_logged: set[str] = set()  # a prefill worker's handle: once each

    def in_flight(self) -> int:
        return self.num_active

    def _remote_kv(self, request: pb.GenerateRequest) -> RemoteKV | None:
        if not request.HasField("kv"):
            return None
        kv = request.kv
        ours = self.runtime.config.kv_transfer.connector
        engine_config = self.runtime.config.engine_for(self.runtime.role)
        mismatch = None
        if kv.connector != ours:
            # A prefill worker of another deployment or config: its handle means nothing
            # to this worker's connector. Computed here (it was a 400 to the client, for
            # the router's pairing, and the lease held until it expired).
            mismatch = f"uses connector {kv.connector!r}, this decode worker {ours!r}"
        elif kv.model_namespace and kv.model_namespace != self.runtime.model_namespace:
            # Other weights (a deployment's prefill and decode workers given different
            # checkpoints or linear_state_dtype): its KV is not this model's.
            mismatch = (f"serves {kv.model_namespace!r}, this decode worker "
                        f"{self.runtime.model_namespace!r}")  # fmt: skip
        elif kv.tp_size and kv.tp_size != engine_config.tensor_parallel_size:
            # Each rank moves its own heads: nothing here matches the prefill worker's
            # blocks. Computed here at once, as a failed pull is (shared storage waited
            # out its timeout for files under another layout, for every prompt).
            mismatch = (f"has tensor_parallel_size {kv.tp_size}, this decode worker "
                        f"{engine_config.tensor_parallel_size}")  # fmt: skip
        if mismatch is not None:
            if mismatch not in self._mismatches_logged:
                self._mismatches_logged.add(mismatch)
                logger.error("a prefill worker %s: its prompts are computed here (give both "
                             "roles the same setting)", mismatch)  # fmt: skip
            return None
        block_size = engine_config.block_size
        if kv.block_size != block_size:
            raise InvalidRequestError(
                f"the KV handle has block_size {kv.block_size}; this worker uses {block_size}",
                "kv",
            )
        # The pull must start early enough to end before the lease does. The router says
        # how long is left of it on monotonic clocks (``lease_left_s``): wall clocks of
        # two hosts 25 s apart let a decode worker pull blocks freed and reused (wrong
        # tokens, no error), or refuse every pull when ahead. CLOCK_SKEW_S covers the
        # call's transit. Without it (a router or prefill worker from before), the
        # prefill worker's wall clock.
        timeout_s = self.runtime.config.kv_transfer.timeout_s
        start_by = None
        now = time.monotonic()
        if kv.HasField("lease_left_s"):
            start_by = now + kv.lease_left_s - timeout_s - CLOCK_SKEW_S
        elif kv.lease_expires_at:
            start_by = now + (kv.lease_expires_at - time.time()) - timeout_s - CLOCK_SKEW_S
        return RemoteKV(
            transfer_id=kv.lease_id,
            num_tokens=kv.num_tokens,
            block_ids=tuple(kv.block_ids),
            source=PeerRef(engine_id=kv.engine_id, endpoint=kv.endpoint),
            start_by=start_by,
            state_block_ids=tuple(kv.state_block_ids),
            block_hashes=tuple(kv.block_hashes),
        )

    @grpc_stream_errors
    async def Generate(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateResponse]:
        with call_span(self.runtime.tracer, "decode", context, request.request_id) as span:
            async_engine = self.runtime.check_accepting()
            params = sampling_from_proto(request.sampling)
            salt = optional(request, "cache_salt")
            lora_name = optional(request, "lora_name")
            remote_kv = self._remote_kv(request)
            self.num_active += 1
            first = True

            async def admitted() -> None:
                """Said at once: a router whose client left may cancel the call now,
                the engine frees the lease (``proto.ADMITTED_KEY``)."""
                await context.send_initial_metadata(((ADMITTED_KEY, "1"),))

            try:
                outputs = async_engine.generate(
                    request.request_id,
                    list(request.prompt_token_ids),
                    params,
                    cache_salt=salt,
                    lora_name=lora_name,
                    lora_fingerprint=optional(request, "lora_fingerprint"),
                    priority=request.priority,
                    remote_kv=remote_kv,
                    output_token_ids=list(request.output_token_ids),
                    draft_token_ids=list(request.draft_token_ids),
                    images=images_from_proto(request.images),
                    on_admitted=admitted if remote_kv is not None else None,
                )
                # Closed with this stream (a cancelled write), not when the collector gets
                # to it: its finally aborts the request in the engine.
                async with contextlib.aclosing(outputs):
                    async for output in outputs:
                        raise_for_error(output)
                        completion = output.outputs[0]
                        reply = pb.GenerateResponse(token_ids=output.new_token_ids)
                        new = completion.last_logprobs(len(output.new_token_ids))
                        reply.logprobs.extend(logprobs_to_proto(lp) for lp in new)
                        if output.finished or first:  # the first reply says what was cached
                            reply.usage.CopyFrom(usage_to_proto(output))
                        if first:  # and, when asked, how likely the prompt was
                            await add_prompt_logprobs(reply.prompt_logprobs, output)
                            # Its queueing, prefill and pull are over: said now, they count
                            # for a sequence the router ends early too (a stop string, a
                            # client gone), which the last reply never reaches.
                            reply.timings.CopyFrom(timings_to_proto(output.times))
                            reply.num_blocks_pulled = output.num_remote_blocks_pulled
                            self.num_blocks_pulled += output.num_remote_blocks_pulled
                            first = False
                        if output.finished:
                            reply.finish_reason = completion.finish_reason or ""
                            reply.timings.CopyFrom(timings_to_proto(output.times))  # + decode
                            # (again: routers before the first reply's read the last's)
                            reply.num_blocks_pulled = output.num_remote_blocks_pulled
                            self.runtime.timer.add(reply.timings)
                            if span.recording:
                                span.set(output_attributes(output))
                        yield reply
            finally:
                self.num_active -= 1

    def stats_extra(self) -> dict[str, int]:
        return {"blocks_pulled": self.num_blocks_pulled}
