"""Shared fixtures: tiny random-weight checkpoints of each architecture, made once per run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The suite runs in 2 processes (pyproject's addopts: pytest-xdist, whole files per
# process, so a module's stack or engine is made once). Each takes one thread for torch's
# own ops: the tiny test models gain nothing from a second one, and two processes of 2
# spinning OpenMP threads on a 2-core machine cost more CPU than they saved (9.4 min with
# one thread each, 13.1 with two; one process with two took 14.6; DESIGN_NOTES). Set
# before torch's import, and inherited by every process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite starts ~200 Python processes (workers, TP shards, routers, CLIs). Where the
# environment sets PYTHONDONTWRITEBYTECODE (this CI image does), each one compiled every
# project module it imported from source, ~0.4 s of CPU per start (~80 CPU-s a run): let
# this process and its children cache bytecode in the checkout (``__pycache__``, ignored).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Each parallel process picks stack ports from its own slice of the range (benchmarks/
# loadgen's free_port_base reads it, in this process and in the benchmarks tests run).
if (_WORKER := os.environ.get("PYTEST_XDIST_WORKER")) is not None:
    _slice = f"{_WORKER.removeprefix('gw')}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
    os.environ.setdefault("PDSERVE_PORT_SLICE", _slice)

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

# The files that take longest (CPU-s each, every process they start included; measured
# 2026-12-02), first: xdist handed files out most tests first, so single-test files
# starting whole stacks came last, one process running one while the other idled.
# Longest first keeps the two busy to the end. The rest keep their collection order.
LONGEST_FILES = (
    "engine/parallel/test_tensor_parallel.py",  # 129
    "router/test_archs_live.py",  # 91
    "deploy/test_drain_scale.py",  # 88
    "worker/test_tensor_parallel_workers.py",  # 75
    "engine/test_parity.py",  # 66
    "router/test_gateway.py",  # 66
    "worker/test_services.py",  # 46
    "router/test_migration.py",  # 36
    "kernels/test_paged_attention.py",  # 33
    "worker/test_faults.py",  # 28
    "deploy/test_autoscale_live.py",  # 25
    "router/test_eagle3_live.py",  # 20
    "router/test_draft_model_live.py",  # 20
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``LONGEST_FILES`` first, each file's tests together and in order (a stable sort:
    both xdist processes collect the same order, as they must)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    tests = Path(__file__).parent

    def first(item: pytest.Item) -> int:
        path = Path(str(item.fspath))
        name = path.relative_to(tests).as_posix() if path.is_relative_to(tests) else ""
        return rank.get(name, len(rank))

    items.sort(key=first)


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5",
         "qwen3_5_moe", "qwen3_next", "gemma3", "phi3", "gpt_oss", "deepseek_v2", "deepseek_v3",
         "glm4_moe", "minimax_m2", "granite", "granite_hybrid", "granite_hybrid_dense",
         "nemotron_h", "nemotron_h_moe", "nemotron_h_latent", "bamba")  # fmt: skip


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


@pytest.fixture(scope="session")
def qwen3_5(model_factory) -> Path:
    """The made Qwen3.5: a hybrid model (gated delta-rule layers between gated attention)."""
    return model_factory("qwen3_5")


@pytest.fixture(scope="session", params=["qwen3_5", "granite_hybrid", "nemotron_h"])
def hybrid(request, model_factory) -> Path:
    """Each hybrid layout: Qwen3.5's (gated delta rule between gated attention), Granite
    4.0-H's (Mamba-2 between rotary-free attention, experts) and Nemotron-H's (one block
    per layer, MLP layers without any cache): what holds of linear-attention layers
    whatever their recurrence and layout."""
    return model_factory(request.param)
