"""Session-wide test setup.

Without CUDA, Triton kernels can only run in Triton's CPU interpreter, and whether a kernel is interpreted is fixed
when its module is imported. Other tests import triton (through flash-linear-attention) long before the Triton
backend's tests run in the same worker, so the interpreter is switched on here, before any test module loads.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A tiny dataset folder per test module (``tests.test_train_support.build_tiny_dataset``)."""
    from tests.test_train_support import build_tiny_dataset

    return build_tiny_dataset(tmp_path_factory.mktemp("tiny"))
