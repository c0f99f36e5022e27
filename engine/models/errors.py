"""The one error a checkpoint or adapter that cannot be loaded raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be loaded; the message names what is missing or unsupported."""


def require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    """``cfg[key]``; a config.json without it cannot be loaded."""
    if key not in cfg:
        raise ModelLoadError(f"{path}: config.json has no {key!r}")
    return cfg[key]
