"""Test-session setup shared by every test module.

Triton decides between compiling and interpreting when a kernel is defined, so the
interpreter must be switched on before anything imports ``lapse.ops`` (and Triton): on a
machine without CUDA the kernels run under ``TRITON_INTERPRET=1``; on a GPU they compile.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
