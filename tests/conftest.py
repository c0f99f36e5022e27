"""Shared fixtures: tiny random-weight checkpoints of each architecture, made once per run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never touch the user's cache: the demo model and other state go under the run's tmp.
# Triton picks interpret-or-compile when a kernel module is imported: without CUDA, every
# test (whoever imports kernels first) runs them in the interpreter.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

_TMP = Path(os.environ.get("TMPDIR", "/tmp"))
os.environ.setdefault("PDSERVE_HOME", str(_TMP / "pdserve-test-home"))

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3",
         "phi3", "gpt_oss")  # fmt: skip


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    """make(arch, size="tiny") -> checkpoint directory, cached for the whole session."""
    from engine.models.maker import make_model

    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, size: str = "tiny") -> Path:
        key = (arch, size)
        if key not in made:
            made[key] = make_model(arch, size, tmp_path_factory.mktemp(f"{arch}-{size}"))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> Path:
    return model_factory("llama")
