"""recompute/functional/nn on the "triton" backend (interpreter on CPU, real kernels on CUDA)."""
import pytest
import torch
import torch.nn as nn

import fusedrc
from _utils import GemmCounter, SavedBytes, rel_err

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _triton():
    with fusedrc.use_backend("triton"):
        yield


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(24, 40), nn.ReLU()),
        lambda: nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Dropout(0.0), nn.Linear(40, 24)),
        lambda: nn.Sequential(nn.Linear(24, 40), nn.SiLU(), nn.Linear(40, 8)),
    ],
    ids=["linear_relu", "ffn_gelu", "ffn_silu"],
)
def test_recompute_pattern_runs_the_kernels(make, device):
    block = make().to(device)
    x = torch.randn(3, 11, 24, device=device, requires_grad=True)
    with SavedBytes() as saved, GemmCounter() as c:
        y = fusedrc.recompute(block, x)
        y.backward(torch.ones_like(y))
    assert saved.bytes == x.numel() * 4, "only x is kept for backward"
    assert c.gemms == 0, f"no aten GEMM may run on the triton path, saw {c.ops}"
    gx = x.grad.clone()
    grads = [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    ref = block(x)
    ref.backward(torch.ones_like(ref))
    assert rel_err(y, ref) < 1e-5 and rel_err(gx, x.grad) < 1e-5
    for a, p in zip(grads, block.parameters()):
        assert rel_err(a, p.grad) < 1e-5


def test_modules_on_triton(device):
    m = fusedrc.nn.FusedMLP(16, 48, activation="gelu_tanh").to(device)
    ref = nn.Sequential(m.fc1, nn.GELU("tanh"), m.fc2)
    x = torch.randn(20, 16, device=device, requires_grad=True)
    assert rel_err(m(x), ref(x)) < 1e-5
