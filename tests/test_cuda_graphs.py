"""CUDA graphs: a training step with fused ops (conv+BN+ReLU, its residual tail, the gated MLP, the
FFN) captured once and replayed does what as many eager steps do: the same gradients and running
statistics; with dropout in the FFN each replay draws a new mask. A layer step at ResNet sizes is
host-bound in eager mode (H200, 2026-11-26), so a graph replay is how such a step gets to its GPU
time. Skipped without a GPU; run in GPU sessions."""
import copy

import pytest
import torch
from torch import nn

import fusedrc
from fusedrc.bench.measure import capture_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs capture "
                                "GPU work")


class _Net(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.unit = fusedrc.nn.ConvBNReLU(8, 16, 3, padding=1)
        self.tail = fusedrc.nn.ConvBNReLU(16, 16, 3, padding=1)
        self.gated = fusedrc.nn.GatedMLP(16, 40)
        self.ffn = fusedrc.nn.FusedMLP(16, 64, 10, activation="gelu", dropout=dropout)

    def forward(self, x):
        h = self.unit(x)
        h = self.tail(h, residual=h).mean((2, 3))
        return self.ffn(h + self.gated(h))


def _step(net, x, g):
    for p in net.parameters():
        p.grad = None
    net(x).backward(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_replays_equal_eager_steps(dtype):
    """2 warm-up steps + 3 replays against 5 eager steps of a copy: every gradient of the last step
    and the running statistics (to rounding: cuDNN's conv backward may pick another algorithm in
    the eager copy), num_batches_tracked exactly."""
    torch.manual_seed(0)
    net = _Net().cuda().to(dtype)
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8, 10, 10, device="cuda", dtype=dtype)
    g = torch.randn(4, 10, device="cuda", dtype=dtype)
    with fusedrc.use_backend("triton"):
        graph = capture_graph(lambda: _step(net, x, g), warmup=2)  # records the step; runs nothing
        for _ in range(3):
            graph.replay()
        for _ in range(5):
            _step(ref, x, g)
    torch.cuda.synchronize()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)
    for (name, b), c in zip(net.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **tol, msg=name)
    assert net.unit.bn.num_batches_tracked.item() == 5 == ref.unit.bn.num_batches_tracked.item()


def test_dropout_mask_is_redrawn_by_each_replay():
    """The FFN's dropout seed is drawn on the GPU inside the step, so every replay of the graph
    gets a new mask (not the captured one over and over), and a replay's gradients are those of an
    eager step with that replay's mask: finite, and different from the previous replay's (the
    inputs, weights and output gradient stay the same: only the mask can change them)."""
    torch.manual_seed(0)
    net = _Net(dropout=0.5).cuda()
    x = torch.randn(4, 8, 10, 10, device="cuda")
    g = torch.randn(4, 10, device="cuda")
    with fusedrc.use_backend("triton"):
        graph = capture_graph(lambda: _step(net, x, g), warmup=2)
        graph.replay()
        first = net.ffn.fc1.weight.grad.clone()
        graph.replay()
    second = net.ffn.fc1.weight.grad
    assert torch.isfinite(first).all() and torch.isfinite(second).all()
    assert not torch.equal(first, second)
