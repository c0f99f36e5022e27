"""The one error a checkpoint or adapter that cannot be loaded raises."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be loaded; the message names what is missing or unsupported."""
