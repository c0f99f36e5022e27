"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU.

Triton chooses compile-or-interpret when a kernel is decorated, i.e. when ``kernels`` is
imported, so every test module that uses the kernels imports this module first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
