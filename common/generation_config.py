"""A checkpoint's sampling defaults from its ``generation_config.json``.

vLLM applies these (``--generation-config auto``, its default) to every request field the
client leaves unset, and transformers' ``generate`` applies them too; a checkpoint such as
Qwen2.5-Instruct ships ``repetition_penalty: 1.05`` and its own temperature and top-p.
The keys read are vLLM's (``do_sample`` is not one of them); ``max_new_tokens`` is the
completion limit of a request that sets none (vLLM's ``get_max_tokens``: never more than
the context leaves). Torch-free: the router reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# transformers' GenerationConfig defaults: a file repeating one sets nothing (top_k 50
# would otherwise turn top-k on where vLLM leaves it off).
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    @classmethod
    def read(cls, model_dir: str | Path) -> GenerationDefaults:
        path = Path(model_dir) / "generation_config.json"
        if not path.exists():
            return cls()
        values = json.loads(path.read_text())

        def number(key: str, kind: type) -> float | int | None:
            value = values.get(key)
            if not isinstance(value, int | float) or value == _HF_DEFAULTS.get(key):
                return None  # as vLLM (transformers' to_diff_dict): a default means unset
            return kind(value)

        return cls(
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            top_k=number("top_k", int),
            min_p=number("min_p", float),
            repetition_penalty=number("repetition_penalty", float),
            max_tokens=_max_new_tokens(values.get("max_new_tokens")),
        )


def _max_new_tokens(value: object) -> int | None:
    """``max_new_tokens`` when it is a positive integer (transformers' default is none)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value
