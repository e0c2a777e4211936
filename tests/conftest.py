import os

import torch

# Without a GPU, Triton kernels run under the interpreter on CPU tensors. The
# variable must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fusedrc  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_backend():
    torch.manual_seed(0)
    with fusedrc.use_backend("auto"):
        yield


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
