"""Timers, the saved-activation-bytes counter and the environment metadata (DESIGN.md section 6)."""
from __future__ import annotations

import contextlib
import gc
import os
import platform
import signal
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from .. import _saved
from .._state import tf32_matmul_allowed

_REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- statistics
def quantile(values, q):
    """Linear-interpolated quantile (numpy's default method)."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(times):
    return {"median_s": quantile(times, 0.5), "p20_s": quantile(times, 0.2), "p80_s": quantile(times, 0.8)}


# --------------------------------------------------------------------------- saved bytes
SavedBytes = _saved.SavedBytes  # the counter fusedrc.convert uses, so the two count alike


# --------------------------------------------------------------------------- timers
class Timer:
    """Times one call of ``fn``: ``time.perf_counter`` on CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.name = "cuda_events" if self.cuda else "time.perf_counter"

    def __call__(self, fn) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        gc.collect()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def do_bench_times(fn, rep: int = 100):
    """Every timing (seconds) ``triton.testing.do_bench`` takes of ``fn`` on the GPU (its 20/50/80th
    percentiles on a Triton without ``return_mode="all"``). ``rep``: the milliseconds it spends timing
    (it runs ``fn`` about rep / (one run's time) times: raise it for steps of tens of ms)."""
    from triton.testing import do_bench

    try:
        ms = do_bench(fn, warmup=25, rep=rep, return_mode="all")
    except TypeError:  # an older triton without return_mode="all"
        ms = do_bench(fn, warmup=25, rep=rep, quantiles=[0.2, 0.5, 0.8])
    return [t / 1e3 for t in ms]


def capture_graph(step, warmup: int = 3):
    """``step`` captured in a CUDA graph, after ``warmup`` calls on a side stream (torch's
    whole-network capture recipe: Triton kernels compile and cuDNN picks its algorithms there; the
    capture records the step and runs nothing). A failed capture can leave its stream current: the
    default stream is made current again before the error propagates."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception:
        torch.cuda.set_stream(torch.cuda.default_stream())
        raise
    return graph


@contextlib.contextmanager
def switches(module, **values):
    """A kernels module's switches (module-level settings: ``GEMM_TMA``, ``CONV_Z``, ...) set to
    ``values`` for the block, put back afterwards whatever happens in it."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def peak_allocated(device: torch.device, fn):
    """``(peak bytes allocated while fn runs, bytes allocated before)``; ``(None, None)`` off CUDA."""
    if device.type != "cuda":
        fn()
        return None, None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), before


# --------------------------------------------------------------------------- environment
def loadavg():
    """The 1/5/15-minute load averages: other processes on the cores make timings noisy."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def triton_version():
    try:
        import triton
    except Exception:
        return None
    return getattr(triton, "__version__", None)


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_bytes=props.total_memory, tf32_matmul=tf32_matmul_allowed(), tf32_cudnn=_tf32_cudnn())
    else:
        info.update(name=cpu_name() or "cpu", capability=torch.backends.cpu.get_cpu_capability())
    return info


def match_fp32_precision(device: torch.device) -> None:
    """One fp32 precision for every strategy on CUDA: cuDNN's convolutions default to TF32 while
    torch's matmuls, and fusedrc's fused ops (they follow the matmul setting), default to IEEE fp32.
    cuDNN is set to the matmul setting; ``device_info`` records both."""
    if device.type == "cuda":
        try:
            torch.backends.cudnn.allow_tf32 = tf32_matmul_allowed()
        except RuntimeError:  # the new API was used (torch >= 2.9): stay with it
            torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32_matmul_allowed() else "ieee"


def _tf32_cudnn() -> bool:
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # set through the new API (torch >= 2.9), which the legacy flag refuses to read
        return torch.backends.cudnn.conv.fp32_precision == "tf32"


def cpu_name():
    """The processor's model name (/proc/cpuinfo, else ``platform.processor()``), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def versions() -> dict:
    import fusedrc

    return {"torch": torch.__version__, "triton": triton_version(), "fusedrc": fusedrc.__version__,
            "python": platform.python_version()}


def git_info():
    def run(*args):
        try:
            r = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    if os.environ.get("FUSEDRC_GIT_COMMIT"):
        # a copy of the tree shipped elsewhere (e.g. a GPU machine), whose .git may be stale or
        # absent: the caller names the commit it copied
        dirty = os.environ.get("FUSEDRC_GIT_DIRTY")
        return os.environ["FUSEDRC_GIT_COMMIT"], None if dirty is None else dirty == "1"
    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no") if commit else None
    return commit, (bool(status) if status is not None else None)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def interrupt_on_sigterm():
    """Turn SIGTERM (``timeout`` in benchmarks/gpu_session.sh) into KeyboardInterrupt, so a script
    that catches it can still write the records it measured. Returns the previous handler."""
    prev = signal.signal(signal.SIGTERM, _interrupt)
    return signal.SIG_DFL if prev is None else prev


def write_results(out_dir, stem: str, kind: str, device: torch.device, **fields) -> Path:
    """Write ``{out_dir}/{stem}_{UTC time}.json``: ``fields`` plus the kind, time, device,
    versions and git commit every results file carries (the scripts under benchmarks/)."""
    import datetime
    import json

    now = datetime.datetime.now(datetime.timezone.utc)
    commit, dirty = git_info()
    doc = dict(kind=kind, timestamp=now.isoformat(), device=device_info(device), **versions(),
               commit=commit, dirty=dirty, **fields)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}_{now:%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def compile_support(device: torch.device):
    """``None`` when ``torch.compile`` can build a tiny function with a backward here, else the reason."""
    import torch._functorch.config as fc

    if not hasattr(fc, "activation_memory_budget"):
        return "this torch has no torch._functorch.config.activation_memory_budget"
    try:
        import torch._dynamo

        lin = nn.Linear(8, 8).to(device)
        torch._dynamo.reset()
        f = torch.compile(lambda x: lin(x).relu().sum())
        f(torch.randn(4, 8, device=device)).backward()
        torch._dynamo.reset()
    except Exception as e:  # no C++ compiler, no Triton for the device, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"torch.compile does not work on this machine: {type(e).__name__}: {first[:200]}"
    return None
