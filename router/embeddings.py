"""``/v1/embeddings``: OpenAI's response shape around the workers' ``Embed`` calls.

Every input is one engine request, placed and run on its own (``Dispatcher.embed``) and
batched there with whatever the worker runs; the reply waits for all of them. One that
fails fails the request, and the rest are cancelled (which aborts them on the workers).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from proto import pdserve_pb2 as pb


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


def encoded(values: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of float32 little-endian
    bytes (what the OpenAI Python client asks for by default and decodes with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return list(values)


def embeddings_response(
    response_id: str,
    model: str,
    replies: Sequence[pb.EmbedResponse],
    num_prompt_tokens: int,
    encoding_format: str,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": encoded(reply.embedding, encoding_format),
            }
            for index, reply in enumerate(replies)
        ],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
