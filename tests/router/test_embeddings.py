"""The embeddings response: OpenAI's document, base64 or floats, a large one sent in pieces
with the event loop free between them; and a request's calls all or none."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest

from proto import pdserve_pb2 as pb
from router.embeddings import PIECE_FLOATS, EmbeddingsBody, all_or_none


def replies(num: int, size: int) -> list[pb.EmbedResponse]:
    rng = np.random.default_rng(0)
    return [
        pb.EmbedResponse(embedding=rng.standard_normal(size).astype("<f4").tobytes())
        for _ in range(num)
    ]


def test_the_document_is_openais_in_either_encoding():
    sent = replies(3, 8)
    for encoding in ("float", "base64"):
        document = EmbeddingsBody("embd-1", "m", sent, 17, encoding)
        assert document.small
        reply = json.loads(document.whole())
        assert {k: reply[k] for k in ("id", "object", "model")} == {
            "id": "embd-1", "object": "list", "model": "m"}  # fmt: skip
        assert reply["usage"] == {"prompt_tokens": 17, "total_tokens": 17}
        assert [item["index"] for item in reply["data"]] == [0, 1, 2]
        for item, original in zip(reply["data"], sent, strict=True):
            assert item["object"] == "embedding"
            values = item["embedding"]
            raw = base64.b64decode(values) if encoding == "base64" else None
            if raw is None:  # float32 values, exactly
                raw = np.asarray(values, dtype="<f4").tobytes()
            assert raw == original.embedding


def test_a_large_float_document_goes_in_pieces_with_the_loop_free_between():
    sent = replies(512, 1024)  # 16x PIECE_FLOATS: ~0.3 s of json.dumps in all
    document = EmbeddingsBody("embd-2", "m", sent, 1, "float")
    assert not document.small and document.num_floats == 512 * 1024 > PIECE_FLOATS

    async def consume() -> tuple[list[bytes], float]:
        gaps, last = [], time.perf_counter()
        stop = asyncio.Event()

        async def tick() -> None:
            nonlocal last
            while not stop.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        pieces = [piece async for piece in document.pieces()]
        stop.set()
        await ticker
        return pieces, max(gaps)

    pieces, longest = asyncio.run(consume())
    assert len(pieces) >= 16
    assert b"".join(pieces) == document.whole()
    assert json.loads(b"".join(pieces))["data"][511]["index"] == 511
    whole_s = time.perf_counter()
    document.whole()
    whole_s = time.perf_counter() - whole_s
    assert longest < max(whole_s / 4, 0.05), (longest, whole_s)


def test_one_failure_cancels_the_other_calls():
    cancelled = []

    async def slow(index: int) -> pb.EmbedResponse:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(index)
            raise
        return pb.EmbedResponse()

    async def failing() -> pb.EmbedResponse:
        await asyncio.sleep(0.01)
        raise RuntimeError("a worker refused it")

    async def run() -> None:
        await all_or_none([slow(0), failing(), slow(2)])

    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(run())
    assert sorted(cancelled) == [0, 2]
