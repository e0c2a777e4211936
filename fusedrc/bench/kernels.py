"""Per-kernel microbenchmarks: a fused op against eager (unfused) and torch.utils.checkpoint.

Each pattern runs forward + backward (``out.backward(grad)``) on inputs that
require grad. Achieved TFLOP/s counts every GEMM/conv the strategy runs,
recompute included (DESIGN.md section 4), in units of the layer's GEMM:

* ``linear_act`` (``relu(x Wᵀ + b)``): eager 3, checkpoint 4, fusedrc 4
* ``fused_mlp`` (``Linear → GELU → Linear``): eager 6, checkpoint 7 (early stop), fusedrc 7
* ``fused_mlp_dropout`` (``Linear → GELU → Dropout(0.1) → Linear``, the fused op regenerates
  the mask in backward from a Philox seed): same counts as ``fused_mlp``
* ``gated_mlp`` (Llama's SwiGLU MLP ``down(silu(gate(x)) * up(x))``, in units of one of its three
  equal GEMMs): eager 9, checkpoint 11 (early stop: down_proj is not rerun), fusedrc 11
* ``moe_experts`` (a MoE layer's routed SwiGLU experts, top-2 of 8, weighted by differentiable routing
  weights; in units of one of an expert's three GEMMs over all routed tokens): eager 9 (the experts loop
  as Hugging Face's eager forward writes it), checkpoint 12 (its recompute reruns the down projection,
  whose output the routing weights' gradient reads), fusedrc 11; shape ``layout="gpt_oss"``: gpt-oss's
  experts (transposed weights, gate and up rows interleaved, biases, its clamped gate), the same counts;
  ``layout="ungated"``: Nemotron-H's squared-ReLU experts ``relu(x Wuᵀ)² Wdᵀ`` (two GEMMs an expert): eager 6,
  checkpoint 8, fusedrc 7
* ``mix_ffn`` (SegFormer's Mix-FFN ``fc2(gelu(dwconv3x3(fc1(x))))`` over a grid of tokens, in units of one
  of its two GEMMs; the depthwise conv's few FLOPs are not counted): eager 6, checkpoint 7, fusedrc 7 (fc1
  rerun; the conv and the activation rebuilt inside the activation's backward kernel)
* ``xielu_mlp`` (Apertus's MLP ``down(xielu(up(x)))``, its alphas learned): eager 6, checkpoint 7, fusedrc 7
* ``conv_bn_act`` (``Conv2d → BatchNorm2d → ReLU``): eager 3, checkpoint 4, fusedrc 4 on the
  reference backend; the Triton kernels' count follows their recompute switches.
* ``bn_act_conv`` (``BatchNorm2d → ReLU → Conv2d``, the pre-activation order; a DenseNet layer's 1×1
  bottleneck conv): eager 3, checkpoint 3 (early stop: its rerun ends at the conv's input), fusedrc 3
  (its backward rebuilds the conv's input from ``x`` elementwise)

On a GPU the fused ops run the Triton kernels and are timed with
``triton.testing.do_bench``; on a CPU they run the reference backend and are timed
with ``time.perf_counter`` (Triton's interpreter is not representative of a
kernel's speed, so it is never timed).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusedrc

from . import measure
from .progress import bar

PATTERNS = ("linear_act", "fused_mlp", "fused_mlp_dropout", "gated_mlp", "norm_gated_mlp", "moe_experts",
            "mix_ffn", "xielu_mlp", "conv_bn_act", "bn_act_conv")
DROPOUT_P = 0.1
STRATEGIES = ("eager", "torch_checkpoint", "fusedrc")
CPU_NOTE = ("CPU: fusedrc runs its reference backend (pure PyTorch); Triton kernels are only timed on a GPU, "
            "Triton's interpreter is not representative and is not timed.")


def shapes(device_type: str, quick: bool) -> list:
    """The (pattern, shape) cases of a run. On CUDA the FFN runs at both shapes its
    targets name: d=4096, hidden=16384, 8192 tokens and d=1024, hidden=4096, 16384 tokens;
    the FFN with dropout at the smaller one, where the mask's cost weighs most; the routed
    experts at Mixtral's few large experts and at Qwen3-MoE's many small ones."""
    if quick:
        return [("linear_act", dict(M=256, K=128, N=512)), ("fused_mlp", dict(M=256, d=128, h=512)),
                ("fused_mlp_dropout", dict(M=256, d=128, h=512)), ("gated_mlp", dict(M=256, d=128, h=344)),
                ("norm_gated_mlp", dict(M=256, d=128, h=344)), ("moe_experts", dict(T=128, d=128, h=172, E=8, k=2)),
                ("mix_ffn", dict(B=2, H=8, W=8, d=32, h=128)), ("xielu_mlp", dict(M=256, d=128, h=512)),
                ("conv_bn_act", dict(N=4, C=16, K=16, H=16, W=16, k=3)),
                ("bn_act_conv", dict(N=4, C=32, K=16, H=8, W=8, k=1))]
    if device_type == "cuda":
        return [("linear_act", dict(M=8192, K=4096, N=16384)), ("fused_mlp", dict(M=8192, d=4096, h=16384)),
                ("fused_mlp", dict(M=16384, d=1024, h=4096)), ("fused_mlp_dropout", dict(M=16384, d=1024, h=4096)),
                ("gated_mlp", dict(M=8192, d=4096, h=11008)),  # Llama-2 7B's MLP, 8192 tokens
                ("norm_gated_mlp", dict(M=8192, d=4096, h=11008)),  # and its post-attention RMSNorm before it
                ("moe_experts", dict(T=8192, d=4096, h=14336, E=8, k=2)),  # Mixtral 8x7B's experts, 8192 tokens
                # Qwen3-30B-A3B's: 128 small experts, top-8 (per-expert launches against the GEMMs)
                ("moe_experts", dict(T=8192, d=2048, h=768, E=128, k=8)),
                # gpt-oss-20b's: 32 experts of 2880, top-4, biases, interleaved gate/up rows read in place
                ("moe_experts", dict(T=8192, d=2880, h=2880, E=32, k=4, layout="gpt_oss")),
                # Nemotron-3-Nano-30B-A3B's: 128 ungated squared-ReLU experts of 1856, top-6 (the dense kernels)
                ("moe_experts", dict(T=8192, d=2688, h=1856, E=128, k=6, layout="ungated")),
                # SegFormer-B2 at 512 x 512, batch 8: stage 1 (128 x 128 tokens of 64) and stage 3 (32 x 32 of 320)
                ("mix_ffn", dict(B=8, H=128, W=128, d=64, h=256)), ("mix_ffn", dict(B=8, H=32, W=32, d=320, h=1280)),
                ("xielu_mlp", dict(M=8192, d=4096, h=21504)),  # Apertus-8B's MLP, 8192 tokens
                ("conv_bn_act", dict(N=64, C=128, K=128, H=56, W=56, k=3)),
                # DenseNet-121's dense layer at 28x28 with 256 input channels: the 1x1 bottleneck to 128
                ("bn_act_conv", dict(N=64, C=256, K=128, H=28, W=28, k=1))]
    return [("linear_act", dict(M=1024, K=512, N=2048)), ("fused_mlp", dict(M=1024, d=512, h=2048)),
            ("fused_mlp_dropout", dict(M=1024, d=512, h=2048)), ("gated_mlp", dict(M=1024, d=512, h=1376)),
            ("norm_gated_mlp", dict(M=1024, d=512, h=1376)), ("moe_experts", dict(T=512, d=512, h=1792, E=8, k=2)),
            ("moe_experts", dict(T=512, d=512, h=512, E=8, k=4, layout="gpt_oss")),
            ("moe_experts", dict(T=512, d=512, h=768, E=16, k=4, layout="ungated")),
            ("mix_ffn", dict(B=4, H=16, W=16, d=64, h=256)), ("xielu_mlp", dict(M=1024, d=512, h=2048)),
            ("conv_bn_act", dict(N=16, C=64, K=64, H=32, W=32, k=3)),
            ("bn_act_conv", dict(N=16, C=128, K=64, H=16, W=16, k=1))]


def _conv_units(backend: str, strategy: str, x, weight) -> float:
    """Convolutions a training step runs (forward, reruns, dX, dW) under ``strategy``."""
    if strategy == "eager":
        return 3
    if strategy == "torch_checkpoint" or backend != "triton":
        return 4
    from fusedrc.kernels import conv_bn_act as k

    m = x.shape[0] * x.shape[2] * x.shape[3]  # stride 1, "same" padding: output pixels = input pixels
    precision = k.dot_precision(x)
    _, fwd_rerun, bwd_twice = k.conv_plan(x, weight, m, precision)
    return 1 + int(fwd_rerun) + 2 + (2 if bwd_twice else 1)


class _SwiGLU(nn.Module):
    """Llama's MLP as eager PyTorch writes it."""

    def __init__(self, d, h):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), \
            nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _NormSwiGLU(_SwiGLU):
    """Llama's post-attention RMSNorm, then its MLP: a decoder layer's FFN sublayer without the residual."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.norm = nn.RMSNorm(d, eps=1e-6)

    def forward(self, x):
        return super().forward(self.norm(x))


class _MoEExperts(nn.Module):
    """A MoE layer's experts for a fixed routing (top-k of E per token, differentiable routing weights),
    as Hugging Face's eager experts forward computes them; ``fused`` is fusedrc's op on the same tensors.
    ``gpt_oss``: gpt-oss's experts, as its eager forward writes them (weights stored (E, in, out), gate and
    up columns interleaved, biases, the gate ``(up.clamp(-7, 7) + 1) * g * sigmoid(1.702 g)`` of
    ``g = gate.clamp(max=7)``). ``ungated``: Nemotron-H's experts, ``relu(x Wu^T)^2 Wd^T``."""

    LIMIT, ALPHA = 7.0, 1.702

    def __init__(self, T, d, h, E, k, generator, layout=None):
        super().__init__()
        self.gpt_oss, self.ungated = layout == "gpt_oss", layout == "ungated"
        if self.gpt_oss:
            self.gate_up_proj = nn.Parameter(torch.randn(E, d, 2 * h, generator=generator) * d ** -0.5)
            self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * h, generator=generator) * 0.1)
            self.down_proj = nn.Parameter(torch.randn(E, h, d, generator=generator) * h ** -0.5)
            self.down_proj_bias = nn.Parameter(torch.randn(E, d, generator=generator) * 0.1)
        else:  # ungated: gate_up_proj holds the up projections alone
            rows = h if self.ungated else 2 * h
            self.gate_up_proj = nn.Parameter(torch.randn(E, rows, d, generator=generator) * d ** -0.5)
            self.down_proj = nn.Parameter(torch.randn(E, d, h, generator=generator) * h ** -0.5)
        scores = torch.rand(T, E, generator=generator)
        self.register_buffer("top_k_index", scores.topk(k, dim=1).indices)
        self.top_k_weights = nn.Parameter(torch.rand(T, k, generator=generator))

    def _expert(self, x, e):
        if self.ungated:
            return nn.functional.linear(torch.relu(nn.functional.linear(x, self.gate_up_proj[e])).square(),
                                        self.down_proj[e])
        if not self.gpt_oss:
            gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            return nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2].clamp(max=self.LIMIT), gate_up[..., 1::2].clamp(-self.LIMIT, self.LIMIT)
        return ((up + 1) * (gate * torch.sigmoid(gate * self.ALPHA))) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(self.top_k_index == e)
            out = out.index_add(0, token, self._expert(x[token], e) * self.top_k_weights[token, slot, None])
        return out

    def fused(self, x):
        if not self.gpt_oss:
            return fusedrc.functional.moe_experts(x, self.top_k_index, self.top_k_weights, self.gate_up_proj,
                                                  self.down_proj, **(dict(gated=False, activation="relu2")
                                                                     if self.ungated else {}))
        return fusedrc.functional.moe_experts(
            x, self.top_k_index, self.top_k_weights, self.gate_up_proj.transpose(1, 2),
            self.down_proj.transpose(1, 2), gate_up_proj_bias=self.gate_up_proj_bias,
            down_proj_bias=self.down_proj_bias, interleaved=True, swiglu_limit=self.LIMIT, swiglu_alpha=self.ALPHA,
            up_offset=1.0)


class _MixFFN(nn.Module):
    """SegFormer's Mix-FFN as Hugging Face's eager forward writes it, on a fixed token grid; ``fused`` is
    fusedrc's op on the same parameters."""

    def __init__(self, H, W, d, h):
        super().__init__()
        self.size = (H, W)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.dwconv = nn.Conv2d(h, h, 3, 1, 1, groups=h)

    def forward(self, x):
        B, N, C = x.shape[0], x.shape[1], self.fc1.out_features
        h = self.dwconv(self.fc1(x).transpose(1, 2).view(B, C, *self.size)).flatten(2).transpose(1, 2)
        return self.fc2(nn.functional.gelu(h))

    def fused(self, x):
        return fusedrc.functional.mix_ffn(x, *self.size, self.fc1.weight, self.fc1.bias, self.dwconv.weight,
                                          self.dwconv.bias, self.fc2.weight, self.fc2.bias, "gelu")


class _XIELUMLP(nn.Module):
    """Apertus's MLP as Hugging Face's eager forward writes it (XIELUActivation's python formula on its raw
    parameters); ``fused`` is fusedrc's op on the same parameters."""

    def __init__(self, d, h):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)
        self.alpha_p, self.alpha_n = nn.Parameter(torch.tensor([0.3])), nn.Parameter(torch.tensor([-0.2]))

    def _alphas(self):
        return nn.functional.softplus(self.alpha_p), 0.5 + nn.functional.softplus(self.alpha_n)

    def forward(self, x):
        h, (ap, an) = self.up_proj(x), self._alphas()
        eps = torch.tensor(-1e-6, dtype=h.dtype, device=h.device)
        return self.down_proj(torch.where(h > 0, ap * h * h + 0.5 * h, (torch.expm1(torch.min(h, eps)) - h) * an
                                          + 0.5 * h))

    def fused(self, x):
        return fusedrc.functional.xielu_mlp(x, self.up_proj.weight, None, self.down_proj.weight, None,
                                            *self._alphas())


class _Case:
    """One pattern: its modules, inputs, output gradient and the three ways to run it."""

    def __init__(self, pattern, shape, device, dtype, backend):
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.pattern, self.shape = pattern, shape
        if pattern == "linear_act":
            M, K, N = shape["M"], shape["K"], shape["N"]
            self.block = nn.Sequential(nn.Linear(K, N), nn.ReLU())
            xs, ys = (M, K), (M, N)
            self.gemm_flops = 2 * M * K * N
            self.units = {"eager": 3, "torch_checkpoint": 4, "fusedrc": 4}
        elif pattern in ("fused_mlp", "fused_mlp_dropout"):
            M, d, h = shape["M"], shape["d"], shape["h"]
            mid = [nn.Dropout(DROPOUT_P)] if pattern == "fused_mlp_dropout" else []
            self.block = nn.Sequential(nn.Linear(d, h), nn.GELU(), *mid, nn.Linear(h, d))
            xs, ys = (M, d), (M, d)
            self.gemm_flops = 2 * M * d * h  # one of the FFN's two GEMMs
            self.units = {"eager": 6, "torch_checkpoint": 7, "fusedrc": 7}
        elif pattern in ("gated_mlp", "norm_gated_mlp"):
            M, d, h = shape["M"], shape["d"], shape["h"]
            self.block = _SwiGLU(d, h) if pattern == "gated_mlp" else _NormSwiGLU(d, h)
            xs, ys = (M, d), (M, d)
            self.gemm_flops = 2 * M * d * h  # one of its three GEMMs
            self.units = {"eager": 9, "torch_checkpoint": 11, "fusedrc": 11}  # FlopCounterMode agrees
        elif pattern == "moe_experts":
            T, d, h, E, k = (shape[n] for n in ("T", "d", "h", "E", "k"))
            self.block = _MoEExperts(T, d, h, E, k, g, layout=shape.get("layout"))
            xs, ys = (T, d), (T, d)
            self.gemm_flops = 2 * T * k * d * h  # one of an expert's GEMMs, over every routed token
            self.units = {"eager": 6, "torch_checkpoint": 8, "fusedrc": 7} if self.block.ungated else \
                {"eager": 9, "torch_checkpoint": 12, "fusedrc": 11}
        elif pattern == "xielu_mlp":
            M, d, h = shape["M"], shape["d"], shape["h"]
            self.block = _XIELUMLP(d, h)
            xs, ys = (M, d), (M, d)
            self.gemm_flops = 2 * M * d * h  # one of its two GEMMs
            self.units = {"eager": 6, "torch_checkpoint": 7, "fusedrc": 7}
        elif pattern == "mix_ffn":
            B, H, W, d, h = (shape[n] for n in ("B", "H", "W", "d", "h"))
            self.block = _MixFFN(H, W, d, h)
            xs, ys = (B, H * W, d), (B, H * W, d)
            self.gemm_flops = 2 * B * H * W * d * h  # one of its two GEMMs
            self.units = {"eager": 6, "torch_checkpoint": 7, "fusedrc": 7}
        else:
            N, C, K, H, W, k = (shape[n] for n in ("N", "C", "K", "H", "W", "k"))
            conv = nn.Conv2d(C, K, k, 1, k // 2, bias=False)
            self.block = nn.Sequential(conv, nn.BatchNorm2d(K), nn.ReLU()) if pattern == "conv_bn_act" else \
                nn.Sequential(nn.BatchNorm2d(C), nn.ReLU(), conv)
            xs, ys = (N, C, H, W), (N, K, H, W)
            self.gemm_flops = 2 * N * K * H * W * C * k * k
            if pattern == "bn_act_conv":
                self.units = {"eager": 3, "torch_checkpoint": 3, "fusedrc": 3}  # FlopCounterMode agrees
        self.block.to(device=device, dtype=dtype).train()
        self.x = torch.randn(xs, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
        if pattern == "conv_bn_act":
            self.units = {s: _conv_units(backend, s, self.x, self.block[0].weight) for s in STRATEGIES}
        self.grad = torch.randn(ys, generator=g).to(device=device, dtype=dtype)
        self.params = list(self.block.parameters())
        self.fused = self.block
        if pattern in ("moe_experts", "mix_ffn", "xielu_mlp"):
            self.fused = self.block.fused
        if pattern in ("gated_mlp", "norm_gated_mlp"):  # the same parameters in fusedrc's module
            b = self.block
            self.fused = fusedrc.nn.GatedMLP.from_modules(b.gate_proj, b.up_proj, b.down_proj, "silu",
                                                          norm=getattr(b, "norm", None))

    def forward(self, strategy):
        if strategy == "eager":
            return self.block(self.x)
        if strategy == "torch_checkpoint":
            return checkpoint(self.block, self.x, use_reentrant=False)
        if self.pattern in ("moe_experts", "mix_ffn", "xielu_mlp"):
            return self.fused(self.x)
        return fusedrc.recompute(self.fused, self.x)  # a recognised pattern: the fused op

    def step(self, strategy):
        self.x.grad = None
        for p in self.params:
            p.grad = None
        self.forward(strategy).backward(self.grad)


def _gemm_rate(device, dtype, timer, repeats):
    """TFLOP/s of a plain matmul (the device's measured GEMM rate for the ratios)."""
    n = 4096 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    ts = [timer(lambda: a @ b) for _ in range(max(repeats, 3))]
    return {"shape": [n, n, n], "median_s": measure.quantile(ts, 0.5),
            "tflops": 2 * n ** 3 / measure.quantile(ts, 0.5) / 1e12}


def run(device, dtype, quick, warmup, repeats, backend, progress=True):
    """``(records, gemm_rate, complete)``; a KeyboardInterrupt (SIGTERM under
    ``measure.interrupt_on_sigterm``) ends the timing early: the (pattern, strategy) pairs timed
    so far are returned, ``complete`` False."""
    timer = measure.Timer(device)
    # keyed by case index: a pattern may run at several shapes
    cases = {i: _Case(p, shape, device, dtype, backend) for i, (p, shape) in enumerate(shapes(device.type, quick))}
    pbar = bar(len(cases) * len(STRATEGIES) * (1 + warmup + repeats), "fusedrc-bench kernels",
               disable=not progress)
    saved, times, complete = {}, {}, False
    try:
        for p, c in cases.items():
            for s in STRATEGIES:
                # what the module holds anyway (parameters, buffers: the MoE case's routing) is no activation
                counter = measure.SavedBytes(c.params + list(c.block.buffers()))
                with counter:
                    out = c.forward(s)
                out.backward(c.grad)
                saved[p, s] = counter.activation_bytes
                times[p, s] = []
                pbar.update(1)
        if device.type == "cuda":
            for p, c in cases.items():
                for s in STRATEGIES:
                    times[p, s] = measure.do_bench_times(lambda: c.step(s))
                    pbar.update(warmup + repeats)
        else:
            for _ in range(warmup):
                for p, c in cases.items():
                    for s in STRATEGIES:
                        c.step(s)
                        pbar.update(1)
            for _ in range(repeats):  # interleaved rounds
                for p, c in cases.items():
                    for s in STRATEGIES:
                        times[p, s].append(timer(lambda: c.step(s)))
                        pbar.update(1)
        complete = True
    except KeyboardInterrupt:
        print("\ninterrupted: writing the patterns timed so far", flush=True)
    finally:
        pbar.close()
    if not any(times.values()):
        raise SystemExit("interrupted before any pattern was timed: nothing written")
    gemm = _gemm_rate(device, dtype, timer, repeats if complete else min(repeats, 3))  # interrupted: be quick
    records = []
    for p, c in cases.items():
        for s in STRATEGIES:
            if not times.get((p, s)):
                continue
            st = measure.summarize(times[p, s])
            flops = c.units[s] * c.gemm_flops
            records.append({"pattern": c.pattern, "strategy": s, "shape": c.shape, "gemm_units": c.units[s],
                            "flops": flops, "times_s": times[p, s], **st,
                            "tflops": flops / st["median_s"] / 1e12,
                            "fraction_of_gemm_rate": flops / st["median_s"] / 1e12 / gemm["tflops"],
                            "saved_activation_bytes": saved[p, s]})
    return records, gemm, complete
