"""OpenAI response bodies (completions and chat, whole and streamed) from choice events."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from proto import pdserve_pb2 as pb
from router.choices import Choice, ChoiceEvent

TokenText = Callable[[int], str]


def usage_body(choices: list[Choice]) -> dict[str, Any]:
    """Token counts; the n samples of one prompt count its tokens once."""
    prompts = {c.prompt_index: c for c in choices}
    prompt_tokens = sum(len(c.request.prompt_token_ids) for c in prompts.values())
    cached = sum(c.usage.cached_tokens for c in prompts.values() if c.usage)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _top_with_sampled(lp: pb.TokenLogprobs, token_text: TokenText) -> dict[str, float]:
    """OpenAI's up to logprobs + 1 entries: the top ones and always the sampled token."""
    top = {token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
    top[token_text(lp.token_id)] = lp.logprob
    return top


def completion_logprobs(
    logprobs: list[pb.TokenLogprobs], token_text: TokenText, text_start: int
) -> dict[str, Any]:
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets, position = [], text_start
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [_top_with_sampled(lp, token_text) for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: list[pb.TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [
                    entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                ],
            }
            for lp in logprobs
        ]
    }


class Formatter:
    """Builds the bodies of one response; ``chat`` selects the chat shapes."""

    def __init__(self, response_id: str, model: str, chat: bool, logprobs: bool,
                 token_text: TokenText, token_ids: bool = False) -> None:  # fmt: skip
        self.token_ids = token_ids
        self.response_id = response_id
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.token_text = token_text
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}
        self._sent_role: set[int] = set()

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _logprobs(self, logprobs: list[pb.TokenLogprobs], index: int) -> Any:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(logprobs, self.token_text)
        # Offsets run over the tokens' own texts, in a stream as in a whole response: the
        # text sent may lag behind them (held back for a stop string or a split character).
        start = self._text_offsets.get(index, 0)
        body = completion_logprobs(logprobs, self.token_text, start)
        self._text_offsets[index] = start + sum(len(token) for token in body["tokens"])
        return body

    def chunk(self, event: ChoiceEvent) -> dict[str, Any]:
        index = event.choice.index
        logprobs = self._logprobs(event.logprobs, index)
        if self.chat:
            delta: dict[str, Any] = {"content": event.text}
            if index not in self._sent_role:
                self._sent_role.add(index)
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": event.finish_reason}  # fmt: skip
        else:
            choice = {"index": index, "text": event.text, "logprobs": logprobs,
                      "finish_reason": event.finish_reason}  # fmt: skip
        if self.token_ids:
            choice["token_ids"] = list(event.token_ids)
        return self._envelope([choice], "chat.completion.chunk" if self.chat else None)

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        body = self._envelope([], "chat.completion.chunk" if self.chat else None)
        body["usage"] = usage_body(choices)
        return body

    def final(self, choices: list[Choice]) -> dict[str, Any]:
        items = []
        for choice in sorted(choices, key=lambda c: c.index):
            text = choice.detokenizer.text
            logprobs = self._logprobs(choice.logprobs, choice.index)
            if self.chat:
                items.append({
                    "index": choice.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                })  # fmt: skip
            else:
                items.append({"index": choice.index, "text": text, "logprobs": logprobs,
                              "finish_reason": choice.finish_reason})  # fmt: skip
            if self.token_ids:
                items[-1]["token_ids"] = list(choice.token_ids)
        body = self._envelope(items, None)
        body["usage"] = usage_body(choices)
        return body

    def _envelope(self, choices: list[dict[str, Any]], obj: str | None) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj or self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
