"""The RPCs both worker services answer alike: Abort, GetTransferMetadata and Stats.

Mixed in ahead of the generated servicer base, whose methods answer UNIMPLEMENTED. A
service adds its own counters to Stats through ``stats_extra``.
"""

from __future__ import annotations

from proto import pdserve_pb2 as pb
from worker.grpc_errors import grpc_errors
from worker.runtime import WorkerRuntime
from worker.stats import stats_reply


class WorkerRPCs:
    runtime: WorkerRuntime

    def stats_extra(self) -> dict[str, int]:
        """This service's own StatsResponse fields."""
        return {}

    @grpc_errors
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        found = await self.runtime.check_ready().abort(request.request_id)
        return pb.AbortResponse(found=found)

    @grpc_errors
    async def GetTransferMetadata(self, request, context) -> pb.TransferMetadataResponse:
        self.runtime.check_ready()
        return pb.TransferMetadataResponse(
            connector=self.runtime.config.kv_transfer.connector, metadata=self.runtime.metadata
        )

    @grpc_errors
    async def Stats(self, request, context) -> pb.StatsResponse:
        runtime = self.runtime
        role = runtime.role.value
        if runtime.async_engine is None:
            return pb.StatsResponse(engine_id=runtime.engine_id, role=role)
        return stats_reply(
            runtime.engine_id,
            role,
            runtime.async_engine.stats,
            runtime.timer,
            runtime.draining,
            **self.stats_extra(),
        )
