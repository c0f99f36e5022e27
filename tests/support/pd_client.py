"""A minimal disaggregated client over gRPC, as the router will drive the workers."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str
    prefill: pb.PrefillResponse | None = None
    chunks: list[pb.GenerateResponse] = field(default_factory=list)


class PDClient:
    def __init__(self, prefill_address: str, decode_address: str) -> None:
        self.prefill_channel = grpc.aio.insecure_channel(prefill_address)
        self.decode_channel = grpc.aio.insecure_channel(decode_address)
        self.prefill = pb_grpc.PrefillServiceStub(self.prefill_channel)
        self.decode = pb_grpc.DecodeServiceStub(self.decode_channel)

    async def close(self) -> None:
        await self.prefill_channel.close()
        await self.decode_channel.close()

    async def generate(
        self, request_id: str, prompt: list[int], sampling: pb.SamplingParams
    ) -> Result:
        first = await self.prefill.Prefill(
            pb.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling),
            timeout=60,
        )
        tokens = [first.first_token_id]
        if first.finish_reason:
            return Result(tokens, first.finish_reason, first)
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=[first.first_token_id],
            sampling=sampling,
            kv=first.kv,
        )
        result = Result(tokens, "", first)
        async for chunk in self.decode.Generate(request, timeout=60):
            result.chunks.append(chunk)
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                result.finish_reason = chunk.finish_reason
        return result

    async def stats(self) -> tuple[pb.StatsResponse, pb.StatsResponse]:
        prefill = await self.prefill.Stats(pb.StatsRequest(), timeout=10)
        decode = await self.decode.Stats(pb.StatsRequest(), timeout=10)
        return prefill, decode
