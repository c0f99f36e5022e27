"""The RPCs both worker services answer alike: Embed, Abort, GetTransferMetadata, Stats and
the loading and unloading of LoRA adapters.

Mixed in ahead of the generated servicer base, whose methods answer UNIMPLEMENTED. A
service adds its own counters to Stats through ``stats_extra``, and counts its calls in
flight in ``num_active`` (a drain waits for them).
"""

from __future__ import annotations

import asyncio

import grpc

from common.config import LORA_NAME_RULE, valid_lora_name
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.pooling import EMBEDDING_SAMPLING, PoolingParams
from proto import pdserve_pb2 as pb
from worker.call_spans import call_span, output_attributes
from worker.convert import optional, timings_to_proto
from worker.grpc_errors import DisabledError, grpc_errors, raise_for_error
from worker.runtime import WorkerRuntime
from worker.stats import stats_reply


class WorkerRPCs:
    runtime: WorkerRuntime
    num_active: int

    def stats_extra(self) -> dict[str, int]:
        """This service's own StatsResponse fields."""
        return {}

    @grpc_errors
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """The prompt's embedding (``engine/pooling.py``), batched with whatever this
        worker runs. A cancelled call aborts the request."""
        with call_span(self.runtime.tracer, "embed", context, request.request_id) as span:
            async_engine = self.runtime.check_accepting()
            self.num_active += 1
            try:
                final: RequestOutput | None = None
                async for output in async_engine.generate(
                    request.request_id,
                    list(request.token_ids),
                    EMBEDDING_SAMPLING,
                    cache_salt=optional(request, "cache_salt"),
                    lora_name=optional(request, "lora_name"),
                    lora_fingerprint=optional(request, "lora_fingerprint"),
                    priority=request.priority,
                    pooling=PoolingParams(
                        normalize=request.normalize, token_ids=tuple(request.logit_token_ids)
                    ),
                ):
                    final = output
                assert final is not None and final.finished
                raise_for_error(final)
                if final.embedding is None:  # aborted here (an Abort RPC by its id)
                    await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
                vector = final.embedding.numpy().astype("<f4", copy=False)
                reply = pb.EmbedResponse(
                    embedding=vector.tobytes(),
                    num_cached_tokens=final.num_cached_tokens,
                    timings=timings_to_proto(final.times),
                )
                self.runtime.timer.add(reply.timings)  # prompt work, as a prefill's
                if span.recording:
                    span.set(output_attributes(final))
                return reply
            finally:
                self.num_active -= 1

    @grpc_errors
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = await self.runtime.check_ready().abort(request.request_id)
        return pb.AbortResponse(found=found)

    @grpc_errors
    async def GetTransferMetadata(self, request, context) -> pb.TransferMetadataResponse:
        runtime = self.runtime
        runtime.check_ready()
        by_rank = runtime.metadata_by_rank
        if request.tp_rank >= len(by_rank):
            raise InvalidRequestError(
                f"tp_rank {request.tp_rank}: this worker has {len(by_rank)} tensor-parallel "
                "rank(s); KV moves only between workers of the same tensor_parallel_size",
                "tp_rank",
            )
        return pb.TransferMetadataResponse(
            connector=runtime.config.kv_transfer.connector, metadata=by_rank[request.tp_rank]
        )

    @grpc_errors
    async def Stats(self, request, context) -> pb.StatsResponse:
        runtime = self.runtime
        role = runtime.role.value
        if runtime.async_engine is None:
            return pb.StatsResponse(engine_id=runtime.engine_id, role=role)
        engine = runtime.async_engine
        return stats_reply(
            runtime.engine_id,
            role,
            engine.stats,
            runtime.timer,
            runtime.draining,
            # Read now, not from the step snapshot: a Stats sent after a load's reply
            # lists it. (The engine thread swaps entries; a tuple copy is atomic.)
            tuple(engine.engine.runner.lora_adapters.values()),
            **self.stats_extra(),
        )

    @grpc_errors
    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context
    ) -> pb.LoadLoraAdapterResponse:
        """Read the adapter off the engine thread (its steps go on), then add it there, so
        no step sees half of it. Loading the files already loaded under the name is a
        no-op; other files under a loaded name are refused (unload first)."""
        async_engine = self._lora_engine()
        if not valid_lora_name(request.name):
            raise InvalidRequestError(f"a LoRA adapter name is {LORA_NAME_RULE}", "lora_name")
        if not request.path:
            raise InvalidRequestError("needs the adapter's directory", "lora_path")
        adapter = await asyncio.to_thread(
            async_engine.engine.read_lora_adapter, request.name, request.path
        )
        max_adapters = self.runtime.config.lora.max_adapters
        added = await async_engine.call(lambda e: e.add_lora_adapter(adapter, max_adapters))
        info = pb.LoraAdapterInfo(name=adapter.name, fingerprint=adapter.fingerprint)
        return pb.LoadLoraAdapterResponse(adapter=info, already_loaded=not added)

    @grpc_errors
    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context
    ) -> pb.UnloadLoraAdapterResponse:
        """New requests for it are refused from now on; those running finish with it."""
        async_engine = self._lora_engine()
        unloaded = await async_engine.call(lambda e: e.unload_lora_adapter(request.name))
        return pb.UnloadLoraAdapterResponse(unloaded=unloaded)

    def _lora_engine(self) -> AsyncEngine:
        if not self.runtime.config.lora.runtime_loading:
            raise DisabledError("loading LoRA adapters at runtime is off (lora.runtime_loading)")
        return self.runtime.check_ready()
