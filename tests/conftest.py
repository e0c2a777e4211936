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
    # cuDNN convs default to tf32 for fp32; the kernels run ieee fp32 unless torch's matmul
    # flag allows tf32, so the eager oracle must not use tf32 either.
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with fusedrc.use_backend("auto"):
            yield
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def strictly_fused_conv(monkeypatch):
    """The conv op's strictly fused passes (the Triton conv, recomputed in the backward's epilogue
    passes): the CPU's default; a GPU's default takes z from cuDNN for 16-bit operands (CONV_Z)."""
    from fusedrc.kernels import conv_bn_act

    monkeypatch.setattr(conv_bn_act, "CONV_Z", "triton")


@pytest.fixture
def direct_conv_kernels(monkeypatch):
    """The grouped convs' DIRECT kernels turned on (opt-in: off by default since the H200 run), at
    the width their tests were written for."""
    from fusedrc.kernels import conv_bn_act

    monkeypatch.setattr(conv_bn_act, "DIRECT_MAX_GROUP_CHANNELS", 32)
