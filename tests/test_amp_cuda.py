"""Mixed precision on CUDA: fp16/bf16 autocast and GradScaler training with fused ops and
generic recompute regions (skipped without a GPU; run on one in GPU sessions)."""
import copy

import pytest
import torch
from torch import nn

import fusedrc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fp16 autocast and "
                                "GradScaler are CUDA features")


class _Net(nn.Module):
    """Conv-BN-ReLU, a generic region (LayerNorm + GELU FFN) and a fused FFN."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.generic = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.ffn = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x, fused):
        run = fusedrc.recompute if fused else (lambda m, t: m(t))
        h = run(self.conv, x).mean((2, 3))
        h = h + run(self.generic, h)
        return run(self.ffn, h)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_matches_eager(dtype):
    torch.manual_seed(0)
    net = _Net().cuda()
    ref = copy.deepcopy(net)
    x = torch.randn(8, 3, 12, 12, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y = net(x, fused=True)
        y_ref = ref(x, fused=False)
    assert y.dtype == y_ref.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    y.float().square().mean().backward()
    y_ref.float().square().mean().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        if name == "conv.0.bias":
            # BatchNorm in training cancels the conv bias: its gradient is rounding noise in both
            scale = ref.conv[0].weight.grad.norm()
            assert p.grad.norm() < 5e-2 * scale and q.grad.norm() < 5e-2 * scale
            continue
        rel = (p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, rel.item())
    torch.testing.assert_close(net.conv[1].running_mean, ref.conv[1].running_mean, rtol=1e-2, atol=1e-3)


def test_gradscaler_training_matches_eager():
    torch.manual_seed(0)
    net = _Net().cuda()
    ref = copy.deepcopy(net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (net, ref)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0 ** 12) for _ in range(2)]
    losses = [[], []]
    for step in range(4):
        x = torch.randn(8, 3, 12, 12, device="cuda")
        t = torch.randint(0, 10, (8,), device="cuda")
        for i, (m, opt, sc) in enumerate(zip((net, ref), opts, scalers)):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(m(x, fused=i == 0), t)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            losses[i].append(loss.item())
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=2e-2)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-2)
