"""How a completion that finished with "stop" ended at a token, and vLLM's ``stop_reason``
for it. Shared by the router (``router/choices.py``) and the offline API
(``engine/llm.py``), so that both show the same text and report the same reason.
Torch-free."""

from __future__ import annotations

from collections.abc import Collection


def ended_by_token(
    token_id: int, stop_token_ids: Collection[int], eos_token_ids: Collection[int]
) -> bool:
    """Whether ``token_id``, the last token of a completion that finished with ``stop``,
    is what stopped it: a stop token or an EOS, whose text is not shown (else a structured
    output completed at it; with ``ignore_eos`` an EOS ends a completion only as its
    grammar's last token)."""
    return token_id in stop_token_ids or token_id in eos_token_ids


def stop_reason_of(
    token_id: int, stop_token_ids: Collection[int], ignore_eos: bool, main_eos_id: int | None
) -> int | None:
    """vLLM's ``stop_reason`` for the token that ended a completion, in its order of
    checks: None for the tokenizer's EOS (``main_eos_id``; unless ``ignore_eos``, also
    when the request lists it among its stop tokens), a stop token's id, another EOS's id
    (vLLM makes generation_config's other EOS ids stop tokens, unless ``ignore_eos``)."""
    if token_id == main_eos_id and not ignore_eos:
        return None
    if token_id in stop_token_ids:
        return token_id
    return None if ignore_eos or token_id == main_eos_id else token_id
