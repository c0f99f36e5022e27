"""``/v1/embeddings``: OpenAI's response shape around the workers' ``Embed`` calls.

Every input is one engine request, placed and run on its own (``Dispatcher.embed``) and
batched there with whatever the worker runs; the reply waits for all of them. One that
fails fails the request, and the rest are cancelled (which aborts them on the workers).

Vectors travel from the workers as float32 bytes. As base64 (the OpenAI client's default)
they go out as they came. As JSON numbers they cost: 2,048 vectors of 4,096 took 4.3 s to
encode, which on the event loop would stall every stream the router serves. So a large
body is encoded and sent a piece at a time, the loop free between pieces.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Sequence

import numpy as np

from proto import pdserve_pb2 as pb

# Floats encoded between two turns of the event loop (~4 ms of json.dumps).
PIECE_FLOATS = 1 << 15


async def all_or_none(calls: Sequence[Awaitable[pb.EmbedResponse]]) -> list[pb.EmbedResponse]:
    """Every call's reply in order; when one raises (or this is cancelled), the others are
    cancelled and awaited before the error goes on, so none runs on unseen."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def encoded(raw: bytes, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of float32 little-endian
    bytes (what the OpenAI Python client asks for by default and decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return np.frombuffer(raw, dtype="<f4").tolist()


class EmbeddingsBody:
    """The response document, whole (``whole``) or in pieces (``pieces``)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        replies: Sequence[pb.EmbedResponse],
        num_prompt_tokens: int,
        encoding_format: str,
    ) -> None:
        self.replies = replies
        self.encoding_format = encoding_format
        head = {"id": response_id, "object": "list", "created": int(time.time()), "model": model}
        usage = {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}
        self.head = json.dumps(head)[:-1].encode() + b', "data": ['
        self.tail = b'], "usage": ' + json.dumps(usage).encode() + b"}"
        self.num_floats = sum(len(reply.embedding) for reply in replies) // 4

    @property
    def small(self) -> bool:
        """Cheap to encode at once: base64, or few enough numbers."""
        return self.encoding_format == "base64" or self.num_floats <= PIECE_FLOATS

    def _items(self, start: int, stop: int) -> bytes:
        return b", ".join(
            json.dumps({"object": "embedding", "index": index,
                        "embedding": encoded(self.replies[index].embedding,
                                             self.encoding_format)}).encode()
            for index in range(start, stop)
        )  # fmt: skip

    def whole(self) -> bytes:
        return self.head + self._items(0, len(self.replies)) + self.tail

    async def pieces(self) -> AsyncIterator[bytes]:
        yield self.head
        index, per_piece = 0, max(1, PIECE_FLOATS * 4 // max(len(self.replies[0].embedding), 1))
        while index < len(self.replies):
            stop = min(index + per_piece, len(self.replies))
            yield (b", " if index else b"") + self._items(index, stop)
            index = stop
            await asyncio.sleep(0)  # other requests run between pieces
        yield self.tail
