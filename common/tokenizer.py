"""Tokenizer loading and chat templates, torch-free (the router tokenizes without torch).

Wraps the checkpoint's own Hugging Face tokenizer (tokenizer.json + tokenizer_config.json,
chat template from tokenizer_config.json or chat_template.jinja), so real checkpoints
tokenize exactly as they do in transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self._tok = AutoTokenizer.from_pretrained(str(model_dir))

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(token_ids))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render the model's own template and tokenize it (special tokens come from it)."""
        text = self._tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(text, add_special_tokens=False)
