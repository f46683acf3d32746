"""Test-session setup shared by every test module.

Triton decides between compiling and interpreting when a kernel is defined, so the
interpreter must be switched on before anything imports ``lapse.ops`` (and Triton): on a
machine without CUDA the kernels run under ``TRITON_INTERPRET=1``; on a GPU they compile.
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def single_thread():
    """Torch on one intra-op thread for the block. Tiny models gain nothing from threads,
    and on a shared CPU their barriers stall (2 threads ran the generation tests 10-100x
    slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread():
    """A module runs on one thread: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with single_thread():
        yield
