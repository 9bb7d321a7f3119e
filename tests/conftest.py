"""Session-wide test setup.

Without CUDA, Triton kernels can only run in Triton's CPU interpreter, and whether a kernel is interpreted is fixed
when its module is imported. Other tests import triton (through flash-linear-attention) long before the Triton
backend's tests run in the same worker, so the interpreter is switched on here, before any test module loads.

Each test process runs torch on one thread: the suite runs as two workers on two cores (``pytest -n 2``), where two
threads per worker wait on each other and make the many tiny forwards 10-20x slower.
"""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported; subprocesses inherit it

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A tiny dataset folder per test module (``tests.test_train_support.build_tiny_dataset``)."""
    from tests.test_train_support import build_tiny_dataset

    return build_tiny_dataset(tmp_path_factory.mktemp("tiny"))
