"""Without a GPU, Triton kernels run in Triton's CPU interpreter (test support only; it must be
set before the kernels module is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
