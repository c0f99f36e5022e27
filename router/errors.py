"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

Raised anywhere in the router; turned into a response in exactly one place (app.py)."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_too_long(
    num_prompt: int,
    max_tokens: int | None,
    max_model_len: int,
    param: str = "prompt",
    at_least: bool = False,
) -> APIError:
    """OpenAI's wording; ``param`` is the request's prompt field ("messages" for chat).
    ``at_least``: ``num_prompt`` is a lower bound (the prompt was not tokenized whole)."""
    where = {"messages": "the messages", "input": "the input"}.get(param, "the prompt")
    if at_least:
        detail = f"{where} resulted in at least {num_prompt} tokens"
    elif max_tokens:
        detail = (
            f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in {where}, "
            f"{max_tokens} in the completion)"
        )
    else:
        detail = f"{where} resulted in {num_prompt} tokens"
    return APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, {detail}. "
        f"Please reduce the length of {where} or completion.",
        "invalid_request_error",
        param,
        "context_length_exceeded",
    )


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided.", "invalid_request_error", None,
                    "invalid_api_key")  # fmt: skip


def model_not_found(model: str) -> APIError:
    shown = model if len(model) <= 256 else model[:256] + "..."  # not a 1 MB echo
    return APIError(
        404,
        f"The model `{shown}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def overloaded(retry_after_s: int = 1) -> APIError:
    return APIError(
        429,
        "The server is overloaded; retry shortly.",
        "rate_limit_exceeded",
        None,
        "rate_limit_exceeded",
        {"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable",
                    {"Retry-After": str(retry_after_s)})  # fmt: skip


def internal(request_id: str) -> APIError:
    """A bug or an unexpected worker error. The details (which may name hosts, paths or
    internals) go to the router's log, not to the client; the id ties the two together."""
    return APIError(
        500,
        f"The server had an error while processing request {request_id}; its log has the details.",
        "internal_error",
        None,
        "internal_error",
    )
