"""materialize: meta-built modules get storage once, in their final dtype, without sympy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.empty_init import materialize

ROOT = Path(__file__).resolve().parents[3]


class _Allocations(TorchDispatchMode):
    """The dtype of every tensor the dispatcher creates while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.dtypes.append(out.dtype)
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.register_buffer("positions", torch.arange(5))
        self.register_buffer("scale", torch.ones(3))


def _meta_block() -> _Block:
    with torch.device("meta"):
        return _Block()


def test_every_tensor_made_once_in_its_final_dtype():
    block = _meta_block()
    with _Allocations() as seen:
        assert materialize(block, "cpu", torch.bfloat16) is block
    assert block.proj.weight.shape == (16, 8) and block.proj.bias.shape == (16,)
    assert isinstance(block.proj.weight, nn.Parameter) and block.proj.weight.requires_grad
    assert {t.dtype for t in (block.proj.weight, block.proj.bias, block.scale)} == {torch.bfloat16}
    assert block.positions.dtype == torch.int64  # integer tables keep their dtype
    assert all(t.device.type == "cpu" for t in [*block.parameters(), *block.buffers()])
    # One allocation per tensor (weight, bias, two buffers), none of them float32.
    assert sorted(map(str, seen.dtypes)) == ["torch.bfloat16"] * 3 + ["torch.int64"]
    # The two-step way this replaced made each floating tensor in float32 first.
    with _Allocations() as before:
        _meta_block().to_empty(device="cpu").to(torch.bfloat16)
    assert before.dtypes.count(torch.float32) == 3


def test_engine_start_does_not_import_sympy(tiny_llama):
    """Building an engine (the model loaded through ``materialize``) leaves sympy
    unimported: ``to_empty`` imported it, ~0.9 s of every worker's and shard's start."""
    code = (
        "import sys\n"
        "from engine import LLM\n"
        f"llm = LLM({str(tiny_llama)!r}, dtype='float32')\n"
        "llm.close()\n"
        "assert 'sympy' not in sys.modules, 'sympy was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
