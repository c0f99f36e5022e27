"""Kernel tests run on CUDA when there is one, else in Triton's interpreter on the CPU."""

from __future__ import annotations

import tests.kernels.triton_env  # noqa: F401  (before any kernel module is imported)
