"""PrefillService: compute a prompt's KV and first token, then hold the KV under a lease.

A thin translator: proto → engine call → proto. Everything that touches the engine or the
connector runs on the engine thread (``AsyncEngine.call`` / hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from common.hashing import state_block_hashes
from engine.async_engine import EngineFailedError
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from prefill_service.leases import LeaseTable
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
)
from worker.grpc_errors import RequestFailedError, grpc_errors, raise_for_error
from worker.runtime import WorkerRuntime
from worker.shared_rpcs import WorkerRPCs

logger = logging.getLogger(__name__)


class PrefillServicer(WorkerRPCs, pb_grpc.PrefillServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.leases = LeaseTable(runtime.config.kv_transfer.lease_s)
        self.num_active = 0

    def in_flight(self) -> int:
        """Prefills running plus leases a decode worker may still pull."""
        return self.num_active + len(self.leases)

    def engine_hook(self) -> None:
        """Engine thread, every loop turn: end the leases whose pulls finished or expired."""
        runtime = self.runtime
        engine = runtime.async_engine.engine
        for lease_id in runtime.connector.poll_finished_exports():
            lease = self.leases.release(lease_id)
            if lease is not None:
                engine.release_kv(lease.request_id)
        for lease in self.leases.pop_expired():
            logger.info("lease %s of %s expired unpulled", lease.lease_id, lease.request_id)
            runtime.connector.release_export(lease.lease_id)
            engine.release_kv(lease.request_id)

    @grpc_errors
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        with call_span(self.runtime.tracer, "prefill", context, request.request_id) as span:
            arrived = time.monotonic()  # (the lease's time is said from here: lease_ttl_s)
            async_engine = self.runtime.check_accepting()
            params = sampling_from_proto(request.sampling)
            salt = optional(request, "cache_salt")
            lora_name = optional(request, "lora_name")
            self.num_active += 1
            final: RequestOutput | None = None
            try:
                async for output in async_engine.generate(
                    request.request_id,
                    list(request.token_ids),
                    params,
                    cache_salt=salt,
                    lora_name=lora_name,
                    lora_fingerprint=optional(request, "lora_fingerprint"),
                    priority=request.priority,
                    prefill_only=True,
                    images=images_from_proto(request.images),
                ):
                    final = output
                assert final is not None and final.finished
                raise_for_error(final)
                completion = final.outputs[0]
                if completion.finish_reason == "abort":
                    await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
                reply = pb.PrefillResponse(
                    first_token_id=completion.token_ids[0],
                    finish_reason=completion.finish_reason or "",
                    num_cached_tokens=final.num_cached_tokens,
                    timings=timings_to_proto(final.times),
                    draft_token_ids=final.draft_token_ids,
                )
                await add_prompt_logprobs(reply.prompt_logprobs, final)
                if completion.logprobs:
                    reply.first_logprobs.CopyFrom(logprobs_to_proto(completion.logprobs[0]))
                if final.kv_block_ids is not None:
                    handle = await async_engine.call(lambda e: self._export(e, final, arrived))
                    reply.kv.CopyFrom(handle)
                self.runtime.timer.add(reply.timings)
                if span.recording:
                    span.set(output_attributes(final))
                return reply
            except BaseException:
                # No reply leaves, so no one will pull or release these blocks: free them, and
                # the lease if the export ran (it may still run after a cancel: the engine
                # thread takes this call after it).
                if final is not None and final.kv_block_ids is not None:
                    request_id = final.request_id
                    with contextlib.suppress(EngineFailedError):
                        release = async_engine.call(lambda e: self._release(e, request_id))
                        await asyncio.shield(release)
                raise
            finally:
                self.num_active -= 1

    def _export(self, engine: LLMEngine, output: RequestOutput, arrived: float) -> pb.KVHandle:
        """Engine thread: put the prompt's blocks under a lease and offer them to peers.
        ``arrived``: when the Prefill call came (``time.monotonic``)."""
        if not engine.holds_kv(output.request_id):  # released meanwhile (ReleaseKV by id)
            raise RequestFailedError("the prompt's blocks were released before the export")
        runtime = self.runtime
        lease = self.leases.grant(output.request_id)
        block_ids = output.kv_block_ids or []
        names = engine.held_block_names(output.request_id)
        # A hybrid model's states go in blocks of their own, under the same lease.
        state_ids = engine.held_state_block_ids(output.request_id)
        state_names = state_block_hashes(names[-1], len(state_ids)) if state_ids else []
        runtime.connector.export_blocks(
            lease.lease_id, [*block_ids, *state_ids], [*names, *state_names]
        )
        return pb.KVHandle(
            engine_id=runtime.engine_id,
            endpoint=runtime.address,
            connector=runtime.config.kv_transfer.connector,
            block_ids=block_ids,
            num_tokens=len(output.prompt_token_ids),
            lease_id=lease.lease_id,
            block_size=engine.config.block_size,
            block_hashes=names,
            lease_expires_at=lease.expires_at_unix,
            lease_ttl_s=lease.expires_at - arrived,
            state_block_ids=state_ids,
            tp_size=engine.config.tensor_parallel_size,
            model_namespace=runtime.model_namespace,
        )

    def _release(self, engine: LLMEngine, request_id: str, lease_id: str = "") -> bool:
        """Engine thread: end ``lease_id`` (or, when empty, the lease of ``request_id``)
        and free the request's held blocks, leased or not. False if nothing was held."""
        if lease_id:
            lease = self.leases.release(lease_id)
            if lease is None:
                return False
            request_id = lease.request_id
        else:
            lease = self.leases.release_request(request_id)
        if lease is not None:
            self.runtime.connector.release_export(lease.lease_id)
        return engine.release_kv(request_id)

    @grpc_errors
    async def ReleaseKV(self, request: pb.ReleaseKVRequest, context) -> pb.ReleaseKVResponse:
        if not request.lease_id and not request.request_id:
            raise InvalidRequestError("ReleaseKV needs a lease_id or a request_id")
        released = await self.runtime.check_ready().call(
            lambda e: self._release(e, request.request_id, request.lease_id)
        )
        return pb.ReleaseKVResponse(released=released)

    def stats_extra(self) -> dict[str, int]:
        return {
            "live_leases": len(self.leases),
            "leases_expired": self.leases.num_expired,
            "leases_released": self.leases.num_released,
        }
