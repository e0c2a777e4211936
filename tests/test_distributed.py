"""fusedrc under torch.distributed: DDP and FSDP2 (fully_shard) with 2 processes, SyncBatchNorm.

Two processes are spawned once per device (gloo on the loopback address) and
train converted models (fused ops from ``fusedrc.convert`` and ``fusedrc.nn``,
generic ``fusedrc.recompute`` regions, a ``fusedrc.mark``-ed block with a fused
op inside) for a few SGD steps. Each rank writes its losses, gradients,
parameters and buffers after every step to a file; this process replays the
same steps with the plain eager model, one shard at a time, and checks what
data parallelism means:

* gradients are the average of the per-shard gradients (BatchNorm uses each
  shard's own batch statistics); parameters after each step follow;
* BatchNorm buffers: DDP broadcasts rank 0's buffers before every forward, so
  each rank's buffers after a step are its shard's update of rank 0's previous
  buffers (FSDP2 does not synchronise buffers: each rank keeps its own chain);
* a BatchNorm-free model equals one process on the whole batch.

On the CPU the models are float64 on the reference backend (tolerance 1e-9);
the CUDA variant (both ranks on GPU 0, gloo) runs DDP over the Triton kernels in
float32 and adds SyncBatchNorm, which torch only trains on GPUs.
"""
import collections
import copy
import datetime
import os
import socket
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fusedrc

WORLD = 2
STEPS = 3
BATCH = 4  # per rank
LR, MOMENTUM = 0.05, 0.9

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2, torch >= 2.6)

    HAS_FSDP2 = True
except ImportError:
    HAS_FSDP2 = False

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


# --------------------------------------------------------------------------- models
class ConvNet(nn.Module):
    """Conv-BN-ReLU chains (convert), a pre-activation BN-ReLU-Conv (convert), a generic region with a
    BatchNorm inside (recompute), a ``fusedrc.nn.ConvBNReLU``, a Linear-ReLU (convert). ``norm`` may be
    SyncBatchNorm."""

    def __init__(self, norm=nn.BatchNorm2d):
        super().__init__()
        self.fused = False
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), norm(8), nn.ReLU(),
        )
        self.pre = nn.Sequential(norm(8), nn.ReLU(), nn.Conv2d(8, 8, 1))
        # not a pattern (the BatchNorm follows the Tanh): a generic region with a plain BatchNorm inside
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(), norm(8))
        self.down = nn.Sequential(collections.OrderedDict(
            conv=nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), bn=norm(8), relu=nn.ReLU()))
        self.head = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 10))

    def forward(self, x):
        x = self.pre(self.features(x))
        x = fusedrc.recompute(self.mid, x) if self.fused else self.mid(x)
        x = fusedrc.recompute(self.down, x) if self.fused else self.down(x)
        return self.head(x.mean((2, 3)))


class MLP(nn.Module):
    """BatchNorm-free: an FFN (convert), a marked block with an FFN inside (generic region
    around a fused op), a ``fusedrc.nn.LinearReLU`` through ``recompute``; 3-D input."""

    def __init__(self):
        super().__init__()
        self.fused = False
        self.ffn = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 12))
        self.block = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 24), nn.SiLU(), nn.Linear(24, 12))
        self.act = nn.Linear(12, 16)
        self.out = nn.Linear(16, 10)

    def forward(self, x):  # x: (batch, 2, 12)
        h = self.ffn(x)
        h += x  # in place on a fused op's output: with FSDP2 the output of a unit, not a view
        x = h + self.block(h)
        h = fusedrc.recompute(self.act, x) if self.fused else torch.relu(self.act(x))
        return self.out(h).mean(1)


# case -> (model kind, wrapper, options)
CASES = {
    "ddp_bn": ("conv", "ddp", {}),
    "ddp_bn_static_graph": ("conv", "ddp", {"static_graph": True}),
    "ddp_mlp": ("mlp", "ddp", {}),
    "ddp_mlp_find_unused": ("mlp", "ddp", {"find_unused_parameters": True}),
    "fsdp2_bn": ("conv", "fsdp2", {}),
    "fsdp2_mlp": ("mlp", "fsdp2", {}),
}
# FSDP2 is left to the CPU run: over gloo it needs all_gather_into_tensor / reduce_scatter_tensor,
# which gloo does not promise for CUDA tensors (two ranks cannot share one GPU with NCCL)
CUDA_CASES = {
    "ddp_bn": CASES["ddp_bn"],
    "ddp_mlp": CASES["ddp_mlp"],
    "ddp_syncbn": ("syncbn", "ddp", {}),
}
EXPECTED_UNITS = {
    "conv": {"features.0": "conv_bn_relu", "features.3": "conv_bn_relu", "pre.0": "bn_relu_conv",
             "head.0": "linear_act", "head.2": "norm"},  # head.2: a LayerNorm whose output is not kept
    "syncbn": {"head.0": "linear_act", "head.2": "norm"},
    "mlp": {"ffn.0": "ffn", "block.1": "norm_ffn"},  # block: LayerNorm -> FFN, the norm inside the op
}


def build(kind, fused, device, dtype):
    """The eager model (seed 0), or its fused twin with the same state_dict."""
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP()
    else:
        model = ConvNet(nn.SyncBatchNorm if kind == "syncbn" else nn.BatchNorm2d)
    model = model.to(device=device, dtype=dtype).train()
    if not fused:
        return model
    model.fused = True
    if kind == "mlp":
        model.act = fusedrc.nn.LinearReLU.from_modules(model.act, "relu")
    elif kind == "conv":
        model.down = fusedrc.nn.ConvBNReLU.from_modules(model.down.conv, model.down.bn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyncBatchNorm chains are reported as left unfused
        model = fusedrc.convert(model, inplace=True)
    plan = model.fusedrc_plan
    assert {u.name: u.kind for u in plan.units if u.selected} == EXPECTED_UNITS[kind], plan
    if kind == "syncbn":
        assert {n for n, _ in plan.skipped} >= {"features.0", "features.3", "pre.0"}, plan
    if kind == "mlp":
        fusedrc.mark(model.block)  # a generic region whose rerun calls the fused FFN
    return model


def batch(step, device, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    x_conv = torch.randn(WORLD * BATCH, 3, 6, 6, generator=g)
    x_mlp = torch.randn(WORLD * BATCH, 2, 12, generator=g)
    y = torch.randint(0, 10, (WORLD * BATCH,), generator=g)
    return x_conv.to(device, dtype), x_mlp.to(device, dtype), y.to(device)


def inputs(kind, step, device, dtype, rows=slice(None)):
    x_conv, x_mlp, y = batch(step, device, dtype)
    x = x_mlp if kind == "mlp" else x_conv
    return x[rows], y[rows]


def _full(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu().clone()


def _state(model):
    params = {n: _full(p) for n, p in model.named_parameters()}
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: _full(b) for n, b in model.named_buffers()}
    return params, grads, buffers


# --------------------------------------------------------------------------- workers
def _train_case(name, rank, device, dtype, cases):
    kind, wrapper, options = cases[name]
    model = build(kind, True, device, dtype)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
        params_of = model
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (WORLD,))
        units = [model.ffn, model.block, model.act] if kind == "mlp" else [model.features, model.mid, model.down, model.head]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
        params_of = model
    opt = torch.optim.SGD(params_of.parameters(), lr=LR, momentum=MOMENTUM)
    record = {"losses": [], "grads": [], "params": [], "buffers": [], "warnings": []}
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(STEPS):
        x, y = inputs(kind, step, device, dtype, rows)
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
        record["warnings"] += [str(w.message) for w in caught]
        params, grads, buffers = _state(params_of)
        opt.step()
        record["losses"].append(loss.detach().cpu())
        record["grads"].append(grads)
        record["params"].append(_state(params_of)[0])
        record["buffers"].append(buffers)
    return record


def _syncbn_cpu_probe(rank):
    """torch's SyncBatchNorm cannot train on CPU tensors across processes, with or without fusedrc."""
    out = {}
    for label, fused in (("eager", False), ("fusedrc", True)):
        model = build("syncbn", fused, torch.device("cpu"), torch.float64)
        x, _ = inputs("conv", 0, torch.device("cpu"), torch.float64, slice(rank * BATCH, (rank + 1) * BATCH))
        try:
            model(x)
            out[label] = None
        except ValueError as e:
            out[label] = str(e)
    return out


def _worker(rank, port, outdir, device_type, dtype_name, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    if device_type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name in cases:
            results[name] = _train_case(name, rank, device, dtype, cases)
        if device_type == "cpu":
            results["syncbn_cpu"] = _syncbn_cpu_probe(rank)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(outdir, device_type, dtype_name, cases):
    mp.spawn(_worker, args=(_free_port(), str(outdir), device_type, dtype_name, cases), nprocs=WORLD, join=True)
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# --------------------------------------------------------------------------- single-process replay
def simulate(kind, wrapper, device, dtype, shards):
    """Replay the steps with the eager model: per-shard gradients averaged, buffers as the wrapper keeps them.

    Returns, per step: the per-shard losses, the averaged gradients, the parameters after the
    step, and the buffers each rank should hold after the step.
    """
    model = build(kind, False, device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    start_buffers = [{n: b.clone() for n, b in model.named_buffers()} for _ in shards]
    out = {"losses": [], "grads": [], "params": [], "buffers": []}
    for step in range(STEPS):
        grads, losses, buffers = None, [], []
        for k, rows in enumerate(shards):
            shard = build(kind, False, device, dtype)
            shard.load_state_dict({**model.state_dict(), **start_buffers[k]})
            x, y = inputs(kind, step, device, dtype, rows)
            loss = F.cross_entropy(shard(x), y)
            loss.backward()
            losses.append(loss.detach().cpu())
            g = {n: p.grad for n, p in shard.named_parameters()}
            grads = g if grads is None else {n: grads[n] + g[n] for n in g}
            buffers.append({n: b.detach().clone() for n, b in shard.named_buffers()})
        grads = {n: v / len(shards) for n, v in grads.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.step()
        out["losses"].append(losses)
        out["grads"].append({n: v.cpu() for n, v in grads.items()})
        out["params"].append({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
        out["buffers"].append([{n: b.cpu() for n, b in bufs.items()} for bufs in buffers])
        # DDP broadcasts rank 0's buffers before the next forward; FSDP2 leaves each rank's own
        start_buffers = [buffers[0]] * len(shards) if wrapper == "ddp" else buffers
    return out


def _shards():
    return [slice(r * BATCH, (r + 1) * BATCH) for r in range(WORLD)]


def _close(actual, expected, tol, what):
    assert actual.keys() == expected.keys(), what
    for n in expected:
        a, e = actual[n], expected[n]
        if e.is_floating_point():
            torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=lambda m: f"{what} {n}: {m}")
        else:
            assert torch.equal(a, e), f"{what} {n}: {a} != {e}"


def check_case(results, name, cases, device, dtype, tol):
    kind, wrapper, _ = cases[name]
    sim = simulate(kind, wrapper, device, dtype, _shards())
    for rank, res in enumerate(results):
        rec = res[name]
        # no DDP/FSDP2 complaint (a parameter marked ready twice, a unit returning a view, ...)
        assert rec["warnings"] == [], rec["warnings"]
        for step in range(STEPS):
            where = f"{name} rank {rank} step {step}"
            torch.testing.assert_close(rec["losses"][step], sim["losses"][step][rank], rtol=tol, atol=tol)
            _close(rec["grads"][step], sim["grads"][step], tol, f"{where} grad")
            _close(rec["params"][step], sim["params"][step], tol, f"{where} param")
            _close(rec["buffers"][step], sim["buffers"][step][rank], tol, f"{where} buffer")
    return sim


# --------------------------------------------------------------------------- CPU: gloo, float64, reference backend
def _available(cases):
    return {k: v for k, v in cases.items() if HAS_FSDP2 or v[1] != "fsdp2"}


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dist_cpu"), "cpu", "float64", _available(CASES))


def _need(name):
    if name not in _available(CASES):
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")


CPU, F64, TOL64 = torch.device("cpu"), torch.float64, 1e-9


@pytest.mark.parametrize("name", list(CASES))
def test_matches_per_shard_average(cpu_results, name):
    """DDP/FSDP2 over a converted model: gradients, parameters and buffers after every step are the
    average of the per-shard eager gradients computed in one process (BatchNorm per shard)."""
    _need(name)
    check_case(cpu_results, name, CASES, CPU, F64, TOL64)


@pytest.mark.parametrize("name", ["ddp_mlp", "ddp_mlp_find_unused", "fsdp2_mlp"])
def test_batchnorm_free_equals_one_process_on_whole_batch(cpu_results, name):
    _need(name)
    whole = simulate("mlp", "ddp", CPU, F64, [slice(None)])
    for rank, res in enumerate(cpu_results):
        rec = res[name]
        for step in range(STEPS):
            _close(rec["grads"][step], whole["grads"][step], TOL64, f"{name} rank {rank} step {step} grad")
            _close(rec["params"][step], whole["params"][step], TOL64, f"{name} rank {rank} step {step} param")


def test_batchnorm_shards_differ_from_whole_batch(cpu_results):
    """Guards the test itself: with BatchNorm the per-shard statistics matter (DDP is not one big batch)."""
    whole = simulate("conv", "ddp", CPU, F64, [slice(None)])
    g = cpu_results[0]["ddp_bn"]["grads"][0]
    assert any(not torch.allclose(g[n], whole["grads"][0][n], rtol=1e-6, atol=1e-9) for n in g)


def test_syncbatchnorm_on_cpu_is_torchs_own_error(cpu_results):
    """torch's SyncBatchNorm trains only on GPUs: on CPU tensors in a process group it raises
    ValueError, and fusedrc (convert + a recompute region around it) raises the same."""
    for res in cpu_results:
        probe = res["syncbn_cpu"]
        assert probe["eager"] is not None and "SyncBatchNorm expected input tensor to be on GPU" in probe["eager"]
        assert probe["fusedrc"] == probe["eager"]


# --------------------------------------------------------------------------- SyncBatchNorm, single process
def test_convert_leaves_syncbatchnorm_unfused():
    """SyncBatchNorm is not fused (fusing would drop the cross-process statistics): convert reports it."""
    model = ConvNet(nn.SyncBatchNorm)
    with pytest.warns(UserWarning, match="SyncBatchNorm is not fused"):
        conv = fusedrc.convert(model)
    plan = conv.fusedrc_plan
    assert {u.name for u in plan.units if u.selected} == {"head.0", "head.2"}
    assert {n for n, _ in plan.skipped} == {"features.0", "features.3", "pre.0", "down.conv"}
    assert isinstance(conv.features[1], nn.SyncBatchNorm)


def test_recompute_region_with_syncbatchnorm_single_process():
    """``recompute(Sequential(Conv2d, SyncBatchNorm, ReLU))`` takes the generic path; outside a process
    group SyncBatchNorm is a BatchNorm: outputs, gradients and running statistics (once) match eager."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SyncBatchNorm(4), nn.ReLU()).double()
    ref = copy.deepcopy(block)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        y = fusedrc.recompute(block, x)
        y.sum().backward()
        y_ref = ref(x.detach().requires_grad_())
        y_ref.sum().backward()
        assert torch.equal(y, y_ref)
    for (n, a), (_, b) in zip(block.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=n)
    for (n, a), (_, b) in zip(block.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), n
    assert int(block[1].num_batches_tracked) == 2


# --------------------------------------------------------------------------- CUDA: both ranks on GPU 0 (gloo), Triton kernels
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (SyncBatchNorm and the Triton kernels)")
def test_cuda_ddp_syncbatchnorm(tmp_path):
    """float32 on the GPU: DDP over the Triton kernels, and SyncBatchNorm (left unfused by
    convert; inside generic recompute regions its rerun all-gathers again in backward) against one
    process on the whole batch (SyncBatchNorm's statistics span all ranks)."""
    results = _spawn(tmp_path, "cuda", "float32", CUDA_CASES)
    device = torch.device("cuda", 0)
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name in ("ddp_bn", "ddp_mlp"):
            check_case(results, name, CUDA_CASES, device, torch.float32, 1e-4)
        whole = simulate("syncbn", "ddp", device, torch.float32, [slice(None)])
        for rank, res in enumerate(results):
            rec = res["ddp_syncbn"]
            for step in range(STEPS):
                where = f"ddp_syncbn rank {rank} step {step}"
                _close(rec["grads"][step], whole["grads"][step], 1e-4, f"{where} grad")
                _close(rec["params"][step], whole["params"][step], 1e-4, f"{where} param")
                _close(rec["buffers"][step], whole["buffers"][step][0], 1e-4, f"{where} buffer")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev
