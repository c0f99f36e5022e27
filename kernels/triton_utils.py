"""Host-side helpers shared by the Triton launchers: where a kernel may run, and dot dtypes.

Triton decides at decoration time (when a kernel module is imported) whether a kernel is
compiled for the GPU or run by its CPU interpreter: ``TRITON_INTERPRET=1`` must be set in the
environment before ``kernels`` is imported for the kernels to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

_TL_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on the CPU)."""
    return not isinstance(kernel, JITFunction)


def require_runnable(kernel: object, *tensors: torch.Tensor) -> None:
    """Raise ``RuntimeError`` unless ``kernel`` can run on the device of ``tensors``.

    A compiled kernel needs every tensor on one CUDA device; an interpreted one runs anywhere.
    """
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise RuntimeError(f"Triton kernel inputs are on several devices: {names}")
    if is_interpreted(kernel):
        return
    device = devices.pop() if devices else torch.device("cpu")
    if device.type != "cuda":
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); to run them on the CPU set "
            "TRITON_INTERPRET=1 before `kernels` is imported"
        )


def dot_dtype(kernel: object, dtype: torch.dtype) -> tl.dtype:
    """The dtype ``tl.dot`` operands are cast to for inputs of ``dtype``.

    The interpreter computes bf16 ``tl.dot`` wrongly (numpy has no bf16: it multiplies the raw
    bits), so there bf16 operands are widened to fp32; compiled kernels keep the input dtype.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype for Triton attention: {dtype}")
    if dtype == torch.bfloat16 and is_interpreted(kernel):
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the reference's precision), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))
