"""The embeddings response: OpenAI's document, base64 or floats, a large one sent in pieces
with the event loop free between them; and a request's calls all or none."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from proto import pdserve_pb2 as pb
from router.embeddings import PIECE_FLOATS, EmbeddingsBody, all_or_none, check_finite
from router.errors import APIError


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
    """Each piece holds at most PIECE_FLOATS numbers, and the event loop runs other tasks
    between any two pieces (a ticking task gets a turn): checked by order of events, not
    by wall time, which a loaded CI machine makes noise of."""
    sent = replies(512, 1024)  # 16x PIECE_FLOATS: ~0.3 s of json.dumps in all
    document = EmbeddingsBody("embd-2", "m", sent, 1, "float")
    assert not document.small and document.num_floats == 512 * 1024 > PIECE_FLOATS

    async def consume() -> tuple[list[bytes], list[str]]:
        events: list[str] = []
        stop = asyncio.Event()

        async def tick() -> None:
            while not stop.is_set():
                events.append("tick")
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        pieces = []
        async for piece in document.pieces():
            pieces.append(piece)
            events.append("piece")
        stop.set()
        await ticker
        return pieces, events

    pieces, events = asyncio.run(consume())
    assert b"".join(pieces) == document.whole()
    assert json.loads(b"".join(pieces))["data"][511]["index"] == 511
    items = pieces[1:-1]  # between the head and the tail
    assert len(items) == 16 and all(p.count(b'"index"') == 32 for p in items)
    # From the first items piece on, a tick between every two pieces.
    order = "".join("p" if e == "piece" else "t" for e in events)
    first = order.index("p", order.index("p") + 1)  # the head and the first items piece
    assert "pp" not in order[first:], order


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


def test_a_vector_json_cannot_carry_is_a_500_that_says_why():
    """NaN or an infinity (a model overflowing in float16) came out as invalid JSON, or
    as Starlette's anonymous 500 mid-way through the document."""
    finite = replies(2, 8)
    check_finite([reply.embedding for reply in finite], "embeddings")  # (passes)
    for bad in (np.nan, np.inf, -np.inf):
        vector = np.ones(8, dtype="<f4")
        vector[3] = bad
        with pytest.raises(APIError) as refused:
            check_finite([finite[0].embedding, vector.tobytes()], "scores")
        assert refused.value.status == 500 and "NaN or infinite" in refused.value.message
