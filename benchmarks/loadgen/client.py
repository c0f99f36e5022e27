"""A streaming /v1/completions client that timestamps every token.

Each request sends token ids with ``ignore_eos`` and ``max_tokens`` (so the output length is
exact), ``stream: true``, ``stream_options.include_usage`` and ``return_token_ids`` (the
vLLM / pdserve extension that puts each chunk's generated token ids next to its text).

Counting tokens. One SSE chunk may carry several tokens, and a chunk's text may be empty
while it carries a token (the detokenizer holds back an incomplete UTF-8 character), so
text is no token count. Per chunk, in this order:
1. ``choices[0].token_ids``: exact;
2. ``choices[0].logprobs.tokens`` (completions logprobs, if the server sent them): exact;
3. otherwise 1 if the chunk has text: an estimate; the final ``usage.completion_tokens``
   then replaces the total (``RequestResult.exact_counts`` is False).
Every token of a chunk gets the chunk's arrival time (``time.perf_counter`` when its
``data:`` line was read).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are seconds; ``start_s`` and ``end_s``
    are from the run's start, ``chunk_times_s`` from this request's start."""

    session_id: int
    turn: int
    prompt_tokens: int
    expected_output_tokens: int
    start_s: float
    end_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)  # chunks that carry tokens
    chunk_tokens: list[int] = field(default_factory=list)
    exact_counts: bool = True
    error: str | None = None
    output_token_ids: list[int] = field(default_factory=list)  # kept out of reports
    priority: int | None = None  # sent as the request's priority; None: not sent

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.output_tokens > 0

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def last_token_s(self) -> float | None:
        """Since this request's start: when its last token arrived."""
        return self.chunk_times_s[-1] if self.chunk_times_s else None


def chunk_token_count(choice: dict[str, Any]) -> tuple[int, bool]:
    """(tokens in one streamed completion choice, whether the count is exact)."""
    token_ids = choice.get("token_ids")
    if token_ids is not None:
        return len(token_ids), True
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"]), True
    return (1 if choice.get("text") else 0), False


class BenchClient:
    """Sends requests over one pooled HTTP/1.1 client. Use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        temperature: float = 0.0,
    ) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.temperature = temperature
        # The whole request's bound (vLLM's benchmark: a total timeout): httpx's own
        # bounds each read alone, so a stream that kept sending ran past it.
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    def body(self, prompt: list[int], max_tokens: int, priority: int | None = None) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if priority is not None:
            body["priority"] = priority
        return body

    async def send(self, result: RequestResult, prompt: list[int], run_start: float) -> None:
        """Stream one request, filling ``result`` (whose ``start_s`` is overwritten with
        the send time). Never raises for a failed request: ``result.error`` says why."""
        start = time.perf_counter()
        result.start_s = start - run_start
        usage_tokens: int | None = None
        done = False
        try:
            async with asyncio.timeout(self.timeout_s):
                done, usage_tokens = await self._stream(result, prompt, start)
        except TimeoutError:
            result.error = f"timed out after {self.timeout_s:g} s (--timeout)"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            result.end_s = time.perf_counter() - run_start
        if result.error is None and not done:  # cut short: its tokens are not the output
            result.error = "the stream ended without [DONE]"
        finish_counts(result, usage_tokens)

    async def _stream(
        self, result: RequestResult, prompt: list[int], start: float
    ) -> tuple[bool, int | None]:
        """(whether ``[DONE]`` came, the usage's token count) of one streamed request."""
        usage_tokens: int | None = None
        body = self.body(prompt, result.expected_output_tokens, result.priority)
        async with self._http.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return False, usage_tokens
            async for line in response.aiter_lines():
                now = time.perf_counter() - start
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return True, usage_tokens
                usage_tokens = record_chunk(result, json.loads(data), now, usage_tokens)
                if result.error:
                    return False, usage_tokens
        return False, usage_tokens


def record_chunk(
    result: RequestResult, chunk: dict[str, Any], now_s: float, usage_tokens: int | None
) -> int | None:
    """Record one parsed SSE chunk; returns the usage count seen so far."""
    if "error" in chunk:
        error = chunk["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return usage_tokens
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        usage_tokens = int(usage["completion_tokens"])
    for choice in chunk.get("choices") or ():
        count, exact = chunk_token_count(choice)
        result.exact_counts &= exact
        result.output_token_ids.extend(choice.get("token_ids") or ())
        if count:
            if result.ttft_s is None:
                result.ttft_s = now_s
            result.chunk_times_s.append(now_s)
            result.chunk_tokens.append(count)
            result.output_tokens += count
    return usage_tokens


def finish_counts(result: RequestResult, usage_tokens: int | None) -> None:
    if result.error is None and usage_tokens is not None and not result.exact_counts:
        result.output_tokens = usage_tokens
    if result.error is None and result.output_tokens == 0:
        result.error = "the stream ended without a token"
