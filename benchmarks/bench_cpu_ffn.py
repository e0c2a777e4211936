"""CPU benchmark: one training step of a residual FFN stack under three strategies.

Each block is ``x + ffn(x)`` with ``ffn = nn.Sequential(Linear(W, H), ReLU(), Linear(H, W))``.
One step is ``zero_grad`` + forward + loss + backward + ``SGD.step``, timed with
``time.perf_counter``. The strategies run on the same model and the same input:

* ``no_recompute``      ``x + ffn(x)``
* ``torch_checkpoint``  ``x + torch.utils.checkpoint.checkpoint(ffn, x, use_reentrant=False)``
* ``fusedrc``           ``x + fusedrc.recompute(ffn, x)`` under ``fusedrc.use_backend("reference")``
                        (the FFN pattern routes to the fused ``fusedrc::fused_mlp`` op)

The residual add sits outside the recomputed region in all three (an add saves
nothing for backward, so this is the same as recomputing the whole block).

Method (DESIGN.md section 6, CPU): a gradient check first (all three agree with
no recompute to a relative error < 1e-4), then warm-up steps (excluded), then
``--repeats`` rounds, each round timing one step of every strategy in turn
(a, b, c, a, b, c, ...) so machine noise hits all of them alike. Reported: the
median, p20 and p80 step time, the raw times, and the bytes autograd saves per
step during the model's forward, counted with
``torch.autograd.graph.saved_tensors_hooks`` (each distinct tensor once, keyed by
storage data_ptr + storage offset + shape; tensors sharing storage with a
parameter, i.e. parameters and their transposed views, excluded).

Run::

    python benchmarks/bench_cpu_ffn.py            # full size, a few minutes on 2 cores
    python benchmarks/bench_cpu_ffn.py --quick    # small shapes, seconds (smoke run)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # Run as a script from a source checkout: import this checkout's fusedrc
    # (sys.path[0] is benchmarks/, and an editable install may resolve
    # ``fusedrc`` to an empty namespace package from outside the repo root).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc.bench.measure import cpu_name, git_info, quantile, triton_version  # noqa: E402
from fusedrc.bench.measure import loadavg as _loadavg  # noqa: E402

STRATEGIES = ("no_recompute", "torch_checkpoint", "fusedrc")
_HERE = Path(__file__).resolve().parent
_LR = 1e-4
_GRAD_RTOL = 1e-4


# --------------------------------------------------------------------------- model
def build_model(width: int, hidden: int, blocks: int, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)) for _ in range(blocks)
    )


def forward(model: nn.ModuleList, x: torch.Tensor, strategy: str) -> torch.Tensor:
    for ffn in model:
        if strategy == "no_recompute":
            x = x + ffn(x)
        elif strategy == "torch_checkpoint":
            x = x + checkpoint(ffn, x, use_reentrant=False)
        elif strategy == "fusedrc":
            x = x + fusedrc.recompute(ffn, x)
        else:
            raise ValueError(f"unknown strategy {strategy!r}")
    return x


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


# --------------------------------------------------------------------------- saved bytes
class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct tensors autograd saves while active (parameters excluded)."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen = {}
        self.param_bytes = 0
        self.count = 0

        def pack(t):
            self.count += 1
            ptr = t.untyped_storage().data_ptr()
            key = (ptr, t.storage_offset(), tuple(t.shape), t.dtype)
            if isinstance(t, nn.Parameter) or ptr in self.param_storages:
                return t
            self.seen.setdefault(key, t.numel() * t.element_size())
            return t

        super().__init__(pack, lambda t: t)

    @property
    def activation_bytes(self) -> int:
        return sum(self.seen.values())


def count_saved_bytes(model, x, strategy):
    model.zero_grad(set_to_none=True)
    counter = SavedBytes(model.parameters())
    with counter:
        out = forward(model, x, strategy)
    loss_fn(out).backward()  # free the graph; the grads are discarded
    model.zero_grad(set_to_none=True)
    return {"activation_bytes": counter.activation_bytes, "distinct_tensors": len(counter.seen),
            "pack_calls": counter.count}


# --------------------------------------------------------------------------- correctness
def check_gradients(model, x):
    """Gradients of the three strategies on the same model and input agree (fp32: rel err < 1e-4)."""
    x = x.detach().clone().requires_grad_(True)
    grads = {}
    for s in STRATEGIES:
        model.zero_grad(set_to_none=True)
        x.grad = None
        loss = loss_fn(forward(model, x, s))
        loss.backward()
        grads[s] = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        grads[s + "_loss"] = loss.item()
    model.zero_grad(set_to_none=True)
    names = ["input"] + [n for n, _ in model.named_parameters()]
    worst = {}
    for s in STRATEGIES[1:]:
        errs = []
        for name, a, b in zip(names, grads[s], grads["no_recompute"]):
            err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            errs.append((err, name))
        err, name = max(errs)
        worst[s] = {"max_rel_err": err, "where": name, "loss": grads[s + "_loss"]}
        ok = err < _GRAD_RTOL
        where = f" ({name})" if err > 0 else ""
        print(f"  grad check {s:>16} vs no_recompute: max rel err {err:.3e}{where} "
              f"{'OK' if ok else 'FAIL'} (< {_GRAD_RTOL:g})")
        assert ok, f"{s}: gradient of {name} differs from no_recompute by rel err {err:.3e}"
    return worst


# --------------------------------------------------------------------------- timing
def timed_step(model, opt, x, strategy) -> float:
    gc.collect()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(forward(model, x, strategy))
    loss.backward()
    opt.step()
    t1 = time.perf_counter()
    if not torch.isfinite(loss):
        raise RuntimeError(f"{strategy}: loss became {loss.item()} during timing")
    return t1 - t0


def summarize(times):
    return {"median_s": quantile(times, 0.5), "p20_s": quantile(times, 0.2), "p80_s": quantile(times, 0.8),
            "min_s": min(times), "max_s": max(times)}


# --------------------------------------------------------------------------- environment
def cpu_info():
    return {"name": cpu_name(), "cores": os.cpu_count()}


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=None, help="model width (default 1024; --quick 256)")
    p.add_argument("--hidden", type=int, default=None, help="FFN hidden size (default 4096; --quick 1024)")
    p.add_argument("--batch", type=int, default=None, help="rows of the input (default 2048; --quick 256)")
    p.add_argument("--blocks", type=int, default=4, help="residual FFN blocks (default 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--input-grad", action="store_true",
                   help="the input requires grad (default: it does not, as a training batch)")
    p.add_argument("--out", default=None,
                   help="result JSON (default benchmarks/results/cpu_ffn.json; --quick: cpu_ffn_quick.json)")
    p.add_argument("--quick", action="store_true", help="small shapes for a smoke run")
    args = p.parse_args(argv)
    small = dict(width=256, hidden=1024, batch=256, repeats=3)
    full = dict(width=1024, hidden=4096, batch=2048, repeats=7)
    for k, v in (small if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = str(_HERE / "results" / ("cpu_ffn_quick.json" if args.quick else "cpu_ffn.json"))
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def _mib(n):
    return n / 2**20


def main(argv=None):
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fusedrc.use_backend("reference")
    dtype = torch.float32
    cpu = cpu_info()
    commit, dirty = git_info()
    print(f"fusedrc {fusedrc.__version__} (backend {fusedrc.current_backend()}), torch {torch.__version__}, "
          f"triton {triton_version()}, {cpu['name']} ({cpu['cores']} cores, {torch.get_num_threads()} threads)")
    print(f"shapes: {args.blocks} x [x + Linear({args.width},{args.hidden}) ReLU Linear({args.hidden},"
          f"{args.width})], input {args.batch}x{args.width} {str(dtype).replace('torch.', '')}, "
          f"input requires grad: {args.input_grad}")

    model = build_model(args.width, args.hidden, args.blocks)
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.width, dtype=dtype)
    if args.input_grad:
        x.requires_grad_(True)

    print("correctness:")
    grad_check = check_gradients(model, x)

    saved = {s: count_saved_bytes(model, x, s) for s in STRATEGIES}

    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    load_start = _loadavg()
    print(f"warm-up: {args.warmup} round(s); timing: {args.repeats} round(s) of {', '.join(STRATEGIES)}")
    for _ in range(args.warmup):
        for s in STRATEGIES:
            timed_step(model, opt, x, s)
    times = {s: [] for s in STRATEGIES}
    for r in range(args.repeats):
        for s in STRATEGIES:
            times[s].append(timed_step(model, opt, x, s))
        print(f"  round {r + 1}/{args.repeats}: " + "  ".join(f"{s} {times[s][-1]:.3f}s" for s in STRATEGIES),
              flush=True)

    load_end = _loadavg()
    stats = {s: summarize(times[s]) for s in STRATEGIES}
    med = {s: stats[s]["median_s"] for s in STRATEGIES}
    ratios = {
        "fusedrc_over_torch_checkpoint": med["fusedrc"] / med["torch_checkpoint"],
        "fusedrc_over_no_recompute": med["fusedrc"] / med["no_recompute"],
        "torch_checkpoint_over_no_recompute": med["torch_checkpoint"] / med["no_recompute"],
        "saved_bytes_fusedrc_over_torch_checkpoint":
            saved["fusedrc"]["activation_bytes"] / max(saved["torch_checkpoint"]["activation_bytes"], 1),
    }

    result = {
        "benchmark": "cpu_ffn",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": "cpu", "name": cpu["name"], "cores": cpu["cores"], "torch_threads": torch.get_num_threads(),
                   "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "versions": {"torch": torch.__version__, "triton": triton_version(), "fusedrc": fusedrc.__version__,
                     "python": platform.python_version()},
        "loadavg_1_5_15min": {"start_timing": load_start, "end_timing": load_end},
        "git_commit": commit,
        "git_dirty": dirty,
        "dtype": str(dtype).replace("torch.", ""),
        "shapes": {"width": args.width, "hidden": args.hidden, "batch": args.batch, "blocks": args.blocks},
        "input_requires_grad": args.input_grad,
        "fusedrc_backend": "reference",
        "step": "zero_grad(set_to_none) + forward + mean(out^2) + backward + SGD(lr=%g).step" % _LR,
        "warmup_rounds": args.warmup,
        "repeats": args.repeats,
        "order": "interleaved per round: " + ", ".join(STRATEGIES),
        "grad_check": grad_check,
        "strategies": {s: {"times_s": times[s], **stats[s], "saved": saved[s]} for s in STRATEGIES},
        "ratios": ratios,
        "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv))),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(f"{'strategy':>18} {'median s':>9} {'p20 s':>8} {'p80 s':>8} {'vs none':>8} {'saved act. MiB':>15}")
    for s in STRATEGIES:
        st = stats[s]
        print(f"{s:>18} {st['median_s']:9.3f} {st['p20_s']:8.3f} {st['p80_s']:8.3f} "
              f"{st['median_s'] / med['no_recompute']:8.3f} {_mib(saved[s]['activation_bytes']):15.2f}")
    r = ratios["fusedrc_over_torch_checkpoint"]
    print(f"fusedrc / torch checkpoint (median step time): {r:.3f}  "
          f"({'at parity' if r <= 1.02 else 'ABOVE the 1.02 parity target'}); "
          f"saved bytes ratio {ratios['saved_bytes_fusedrc_over_torch_checkpoint']:.3f}")
    if load_end and load_end[0] > torch.get_num_threads() + 0.75:
        print(f"note: load average {load_end[0]:.2f} at the end: other processes shared the cores, "
              "the timings are noisy")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
