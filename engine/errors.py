"""Typed errors for bad input. Services map them to HTTP 400 / gRPC INVALID_ARGUMENT in one place.

An ``InvalidRequestError`` is raised before a request enters the engine, so the engine's
state is untouched and it keeps serving the next request.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as given. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EmptyPromptError(InvalidRequestError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty: it must contain at least one token", "prompt")


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus, where the caller reserves them, the completion tokens) does not fit."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, max_tokens: int = 0) -> None:
        if max_tokens:
            detail = (
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} "
                f"in the prompt, {max_tokens} for the completion)"
            )
        else:
            detail = f"your prompt has {num_prompt_tokens} tokens"
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"{detail}. Please reduce the length of the prompt or the completion.",
            "prompt",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class InvalidSamplingParamsError(InvalidRequestError):
    pass


class UnknownLoraAdapterError(InvalidRequestError):
    """The request names an adapter this engine does not serve: unloaded after the router
    placed it, most often (a worker says it as NOT_FOUND, the router as a 404)."""

    def __init__(self, lora_name: str, loaded: list[str]) -> None:
        shown = ", ".join(sorted(loaded)) or "none"
        super().__init__(f"unknown LoRA adapter {lora_name!r} (loaded: {shown})", "lora_name")
        self.lora_name = lora_name


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in the engine", "request_id")
