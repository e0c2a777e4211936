"""Compile every kernel configuration for its GPU target on the CPU and report its resources.

``python -m fusedrc.inspect [--arch sm_90|sm_80|all] [--kernel SUBSTRING] [--jobs N] [--json]``

No GPU is needed: Triton's ahead-of-time path (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``) builds the cubin on the CPU, and the
``cuobjdump`` shipped inside Triton's package reads it back. For each compiled
configuration the report gives

- ``registers``: registers per thread (``REG``),
- ``shared_bytes``: Triton's dynamic shared memory (``metadata.shared``) plus
  the cubin's static ``SHARED``,
- ``spill_bytes``: ``STACK`` + ``LOCAL`` bytes per thread (0 means no spill),
- ``mma``: ``"HGMMA"`` (sm_90 warpgroup MMA), ``"HMMA"`` (mma.sync) or ``"none"``
  (FMA units), from the SASS (not disassembled when the PTX has no ``wgmma`` /
  ``mma.sync`` at all: then ``"none"``).

``--json`` prints a list with one object per compiled configuration and exactly the
keys ``kernel`` (str), ``arch`` (``"sm_90"``/``"sm_80"``), ``dtype`` (a torch dtype
name: ``"float16"``, ``"bfloat16"``, ``"float32"``), ``config`` (object: block sizes,
warps, stages; plus ``input_precision`` for fp32 GEMMs and ``mode``, the launch
variant, for a kernel launched in several constexpr modes), ``registers``,
``shared_bytes``, ``spill_bytes`` (ints), ``mma`` (str) and ``gemm`` (bool). The
text table warns about spills and about shared memory over the target's limit
(``SHARED_MEMORY_LIMIT``); ``tests/test_inspect.py`` requires neither to happen and
HGMMA for every fp16/bf16 GEMM on sm_90. Exit status: 0 when everything compiled,
1 when a compile or a module failed, 2 when ``ptxas``/``cuobjdump`` are missing.

Plug-in convention: any module of ``fusedrc.kernels`` may define
``inspect_specs()`` returning a list of dicts, one per compile::

    fn          the @triton.jit kernel
    kernel      its name (str)
    arch        "sm_90" or "sm_80"
    dtype       torch dtype or its name ("bfloat16", "fp16", ...)
    config      dict: block sizes, warps, stages (reported as is; JSON-serialisable)
    signature   argument name -> Triton type ("*fp16", "i32", "fp32", ...) or
                "constexpr"; arguments named in constexprs may be left out
    constexprs  argument name -> value
    num_warps, num_stages
    gemm        bool: the kernel does a matrix product
    aligned     optional: argument names given the 16-divisibility hint that a
                launch with aligned pointers / multiple-of-16 ints gets
    options     optional: extra compile options
    source      optional: label shown in the text table (e.g. the table entry)

Modules are found with ``pkgutil`` over ``fusedrc.kernels``. The compiles run in
worker subprocesses (``--jobs`` of them) whose environment has no
``TRITON_INTERPRET``: a kernel module imported under the interpreter holds
``InterpretedFunction`` objects, which cannot be compiled, so the parent only
reads the specs' metadata and the workers import the modules afresh. Triton's
on-disk cache is used as usual.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pkgutil
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

if importlib.util.find_spec("triton") is None:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fusedrc.inspect needs Triton (it compiles the kernels ahead of time for sm_90/sm_80 "
        "on the CPU; no GPU needed). Install it with `pip install triton`."
    )

__all__ = [
    "ARCHS", "RESULT_KEYS", "SHARED_MEMORY_LIMIT", "InspectionReport",
    "discover_specs", "compile_spec", "inspect_kernels", "format_table", "main", "toolchain_problem",
]

#: target name -> CUDA compute capability compiled for
ARCHS = {"sm_90": 90, "sm_80": 80}
#: largest shared memory one block may use (opt-in), per target
SHARED_MEMORY_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
#: the keys of every result, in order
RESULT_KEYS = ("kernel", "arch", "dtype", "config", "registers", "shared_bytes", "spill_bytes", "mma", "gemm")

_KERNELS_PACKAGE = "fusedrc.kernels"
_REQUIRED = ("fn", "kernel", "arch", "dtype", "config", "signature", "constexprs", "num_warps", "num_stages",
             "gemm")
_DTYPE_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp64": "float64", "double": "float64",
    "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2",
}


# --------------------------------------------------------------------------- specs
@dataclass
class _Spec:
    id: str            # "module:index", stable across processes
    module: str
    kernel: str
    arch: str
    dtype: str
    config: dict
    gemm: bool
    source: str
    raw: dict = field(repr=False)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype.replace("torch.", "")
        return _DTYPE_ALIASES.get(name, name)
    return str(dtype).replace("torch.", "")


def _kernel_modules():
    """Names of the modules of fusedrc.kernels, sorted."""
    pkg = importlib.import_module(_KERNELS_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))


def _module_specs(module_name: str):
    mod = importlib.import_module(f"{_KERNELS_PACKAGE}.{module_name}")
    make = getattr(mod, "inspect_specs", None)
    if make is None or not callable(make):
        return []
    out = []
    for i, raw in enumerate(make()):
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"{module_name}.inspect_specs()[{i}] lacks {missing}")
        if raw["arch"] not in ARCHS:
            raise ValueError(f"{module_name}.inspect_specs()[{i}]: arch must be one of {sorted(ARCHS)}, "
                             f"got {raw['arch']!r}")
        out.append(_Spec(
            id=f"{module_name}:{i}", module=module_name, kernel=str(raw["kernel"]), arch=raw["arch"],
            dtype=_dtype_name(raw["dtype"]), config=dict(raw["config"]), gemm=bool(raw["gemm"]),
            source=str(raw.get("source", "")), raw=raw,
        ))
    return out


# the fused ops whose launchers run a kernel kept in a shared module (fusedrc/kernels/_common.py)
_SHARED_BY = {"_gemm_act_kernel": ("linear_act", "fused_mlp"), "_gemm_act_grad_kernel": ("linear_act", "fused_mlp")}


def _names(spec) -> tuple:
    """What ``--kernel`` matches a spec by: its kernel, its module and the ops that use it."""
    return (spec.kernel, spec.module, *_SHARED_BY.get(spec.kernel, ()))


def discover_specs(arch: str = "all", kernel: str | None = None):
    """(specs, failures): the specs of every kernels module with ``inspect_specs``, filtered
    by arch and by a substring of the kernel's name, its module's or an op's that runs it
    (``_gemm_act_kernel``, ``conv_bn_act``, ``fused_mlp``); a module that fails to import or to list its specs gives a
    failure entry instead."""
    if arch != "all" and arch not in ARCHS:
        raise ValueError(f"arch must be 'all' or one of {sorted(ARCHS)}, got {arch!r}")
    specs, failures = [], []
    for name in _kernel_modules():
        try:
            found = _module_specs(name)
        except Exception:  # noqa: BLE001 - reported, not hidden
            failures.append({"module": name, "error": traceback.format_exc()})
            continue
        specs += [s for s in found
                  if (arch == "all" or s.arch == arch) and (kernel is None or any(kernel in n for n in _names(s)))]
    return specs, failures


def _spec_by_id(spec_id: str) -> _Spec:
    module, index = spec_id.rsplit(":", 1)
    return _module_specs(module)[int(index)]


# --------------------------------------------------------------------------- compiling
def _ast_source(fn, signature: dict, constexprs: dict, attrs: dict):
    """Build an ASTSource across Triton versions.

    Triton >= 3.3 (through 3.9): ``ASTSource(fn, signature, constexprs, attrs)`` with the
    signature keyed by name and listing constexpr arguments as ``"constexpr"``, and attrs
    ``{(arg_index,): [["tt.divisibility", 16]]}``. Older releases name the third argument
    ``constants``; their attrs format differs, so hints are dropped there.
    """
    from triton.compiler import ASTSource
    import inspect as _pyinspect

    params = _pyinspect.signature(ASTSource.__init__).parameters
    if "constexprs" in params:
        try:
            return ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs), True
        except TypeError:
            return ASTSource(fn, signature=signature, constexprs=constexprs), False
    if "constants" in params:
        return ASTSource(fn, signature=signature, constants=constexprs), False
    return ASTSource(fn, signature, constexprs), False


def _nvidia_tool(name: str) -> str:
    """Path of an NVIDIA binary Triton ships (``ptxas``, ``cuobjdump``): Triton's knob, its package, PATH."""
    try:
        from triton import knobs
        tool = getattr(knobs.nvidia, name)
        if tool is not None and getattr(tool, "path", None):
            return tool.path
    except Exception:  # noqa: BLE001 - older Triton: no knobs, or not found there
        pass
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(path):
        return path
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(f"{name} not found (neither in Triton's package nor on PATH)")


def toolchain_problem() -> str | None:
    """None when ``ptxas`` and ``cuobjdump`` (shipped in Triton's package) are usable, else why not."""
    for name in ("ptxas", "cuobjdump"):
        try:
            path = _nvidia_tool(name)
        except Exception as e:  # noqa: BLE001 - the reason is the answer
            return str(e)
        if not os.access(path, os.X_OK):
            return f"{path} is not executable"
    return None


_RESOURCE_RE = re.compile(r"Function\s+(\S+?):\s*\n\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


# PTX matrix instructions: without any, the SASS cannot hold HGMMA/HMMA either
_PTX_MMA_RE = re.compile(r"\b(wgmma\.|mma\.sync)")


def _read_cubin(cubin: bytes, name: str, ptx: str | None = None):
    """(registers, static shared, stack + local bytes, mma kind) of the named function.

    The MMA kind comes from the SASS; disassembling is skipped (``"none"``) when the
    PTX, if given, has no ``wgmma``/``mma.sync`` instruction at all.
    """
    tool = _nvidia_tool("cuobjdump")
    want_sass = ptx is None or _PTX_MMA_RE.search(ptx) is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True)
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True,
                              check=True).stdout if want_sass else ""
    funcs = {m.group(1): tuple(int(g) for g in m.groups()[1:]) for m in _RESOURCE_RE.finditer(usage.stdout)}
    if not funcs:
        raise RuntimeError(f"cannot parse cuobjdump --dump-resource-usage output:\n{usage.stdout}")
    reg, stack, shared, local = funcs.get(name) or next(iter(funcs.values()))
    if re.search(r"\bHGMMA\b", sass):
        mma = "HGMMA"
    elif re.search(r"\bHMMA\b", sass):
        mma = "HMMA"
    else:
        mma = "none"
    return reg, shared, stack + local, mma


def compile_spec(raw: dict, spec_id: str = "") -> dict:
    """Compile one spec dict for its target and return its result (the RESULT_KEYS).

    Needs real ``JITFunction`` kernels: call it in a process where TRITON_INTERPRET was
    unset when the kernels module was imported (``inspect_kernels`` takes care of it).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    fn = raw["fn"]
    if not isinstance(fn, JITFunction):
        raise RuntimeError(
            f"{raw['kernel']} is a {type(fn).__name__}, not a JITFunction (was TRITON_INTERPRET set when its "
            "module was imported?); use inspect_kernels(), which compiles in clean subprocesses")
    constexprs = dict(raw["constexprs"])
    given = dict(raw["signature"])
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in given and given[name] != "constexpr":
            signature[name] = given[name]
        else:
            raise ValueError(f"{raw['kernel']}: argument {name!r} has neither a type nor a constexpr value")
    extra = set(given) - set(fn.arg_names)
    if extra:
        raise ValueError(f"{raw['kernel']}: signature names unknown arguments {sorted(extra)}")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in raw.get("aligned", ())}
    src, _ = _ast_source(fn, signature, constexprs, attrs)
    target = GPUTarget("cuda", ARCHS[raw["arch"]], 32)
    options = {"num_warps": int(raw["num_warps"]), "num_stages": int(raw["num_stages"])}
    options.update(raw.get("options") or {})
    compiled = triton.compile(src, target=target, options=options)
    meta = compiled.metadata
    dynamic = int(meta["shared"] if isinstance(meta, dict) else meta.shared)
    name = meta["name"] if isinstance(meta, dict) else meta.name
    registers, static, spill, mma = _read_cubin(compiled.asm["cubin"], name, compiled.asm.get("ptx"))
    return {
        "kernel": str(raw["kernel"]),
        "arch": raw["arch"],
        "dtype": _dtype_name(raw["dtype"]),
        "config": dict(raw["config"]),
        "registers": int(registers),
        "shared_bytes": dynamic + int(static),
        "spill_bytes": int(spill),
        "mma": mma,
        "gemm": bool(raw["gemm"]),
    }


# --------------------------------------------------------------------------- workers
def _worker_main() -> int:
    """Read spec ids (one JSON string a line) on stdin, answer one JSON object a line."""
    import warnings

    warnings.filterwarnings("ignore")
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by Triton or the compilers goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        spec_id = json.loads(line)
        t0 = time.perf_counter()
        try:
            spec = _spec_by_id(spec_id)
            answer = {"id": spec_id, "result": compile_spec(spec.raw, spec_id)}
        except Exception:  # noqa: BLE001 - sent back to the parent
            answer = {"id": spec_id, "error": traceback.format_exc()}
        answer["seconds"] = time.perf_counter() - t0
        proto.write(json.dumps(answer) + "\n")
    return 0


def _worker_env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    return env


def _start_worker(stderr_file):
    return subprocess.Popen(
        [sys.executable, "-m", "fusedrc.inspect", "--worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file, text=True, bufsize=1,
        env=_worker_env(),
    )


def _run_workers(spec_ids, jobs: int, progress=None):
    """{spec id: answer dict} for every id, compiled by ``jobs`` worker processes."""
    todo = queue.Queue()
    for sid in spec_ids:
        todo.put(sid)
    answers = {}
    lock = threading.Lock()

    def serve():
        with tempfile.TemporaryFile("w+") as err:
            proc = None
            try:
                while True:
                    try:
                        sid = todo.get_nowait()
                    except queue.Empty:
                        return
                    if proc is None or proc.poll() is not None:
                        err.seek(0)
                        err.truncate()
                        proc = _start_worker(err)
                    try:
                        proc.stdin.write(json.dumps(sid) + "\n")
                        proc.stdin.flush()
                        line = proc.stdout.readline()
                    except (BrokenPipeError, OSError):
                        line = ""
                    if line:
                        answer = json.loads(line)
                    else:  # the worker died on this spec: report it, start a fresh one for the rest
                        proc.wait()
                        err.seek(0)
                        answer = {"id": sid, "error": f"worker exited with {proc.returncode}:\n{err.read()[-4000:]}",
                                  "seconds": 0.0}
                        proc = None
                    with lock:
                        answers[sid] = answer
                        if progress:
                            progress(len(answers), len(spec_ids), answer)
            finally:
                if proc is not None and proc.poll() is None:
                    proc.stdin.close()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()

    threads = [threading.Thread(target=serve, daemon=True) for _ in range(max(1, min(jobs, len(spec_ids))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


# --------------------------------------------------------------------------- driver
@dataclass
class InspectionReport:
    """What :func:`inspect_kernels` found: one result dict per compiled configuration
    (``RESULT_KEYS``: registers, shared memory, spills, MMA kind), the failures, and timings."""

    results: list          # one dict with exactly RESULT_KEYS per compiled configuration, in spec order
    failures: list         # {"kernel", "arch", "dtype", "config", "source", "error"} or {"module", "error"}
    sources: list          # per result: the spec's "source" label
    seconds: list          # per result: compile + cuobjdump time in its worker
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every configuration compiled."""
        return not self.failures


def inspect_kernels(arch: str = "all", kernel: str | None = None, jobs: int | None = None,
                    progress=None) -> InspectionReport:
    """Compile every matching spec of every kernels module; see the module docstring."""
    t0 = time.perf_counter()
    specs, failures = discover_specs(arch, kernel)
    jobs = jobs or os.cpu_count() or 1
    answers = _run_workers([s.id for s in specs], jobs, progress) if specs else {}
    results, sources, seconds = [], [], []
    for s in specs:
        a = answers[s.id]
        if "result" in a:
            results.append(a["result"])
            sources.append(s.source)
            seconds.append(a["seconds"])
        else:
            failures.append({"kernel": s.kernel, "arch": s.arch, "dtype": s.dtype, "config": s.config,
                             "source": s.source, "error": a["error"]})
    return InspectionReport(results, failures, sources, seconds, time.perf_counter() - t0)


def _config_text(cfg: dict) -> str:
    short = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "GROUP_M": "GM", "num_warps": "w",
             "num_stages": "s", "input_precision": "", "EPILOGUE_SPLIT": "split"}
    parts = []
    for k, v in cfg.items():
        label = short.get(k, k)
        parts.append(f"{label}{v}" if label in ("BM", "BN", "BK", "GM", "w", "s") else
                     (str(v) if label == "" else f"{label}={v}"))
    return " ".join(parts)


def format_table(report: InspectionReport) -> str:
    """The report as a text table (one row per configuration), with totals and warnings
    for configurations over a target's shared memory or with register spills."""
    header = ("kernel", "arch", "dtype", "config", "regs", "shared", "spill", "mma", "gemm", "s", "source")
    rows = []
    for r, src, sec in zip(report.results, report.sources, report.seconds):
        rows.append((r["kernel"], r["arch"], r["dtype"], _config_text(r["config"]), str(r["registers"]),
                     f"{r['shared_bytes'] / 1024:.1f}K", str(r["spill_bytes"]), r["mma"],
                     "y" if r["gemm"] else "n", f"{sec:.1f}", src))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    warn = []
    for r in report.results:
        limit = SHARED_MEMORY_LIMIT[r["arch"]]
        if r["shared_bytes"] > limit:
            warn.append(f"over {r['arch']} shared memory ({r['shared_bytes']} > {limit}): {r['kernel']} "
                        f"{r['dtype']} {_config_text(r['config'])}")
        if r["spill_bytes"]:
            warn.append(f"spills {r['spill_bytes']} B: {r['kernel']} {r['arch']} {r['dtype']} "
                        f"{_config_text(r['config'])}")
    lines.append("")
    lines.append(f"{len(report.results)} compiled, {len(report.failures)} failed, "
                 f"{report.wall_seconds:.1f} s wall")
    lines += ["WARNING: " + w for w in warn]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command line of ``python -m fusedrc.inspect [--arch A] [--kernel S] [--jobs N] [--json]``.

    Returns the exit status: 0 when every configuration compiled, 1 on a failure,
    2 when the toolchain (``ptxas``/``cuobjdump`` from Triton's package) is missing.
    """
    ap = argparse.ArgumentParser(prog="python -m fusedrc.inspect", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="all", choices=["all", *ARCHS])
    ap.add_argument("--kernel", default=None, metavar="SUBSTRING",
                    help="only kernels whose name or kernels module (linear_act, fused_mlp, gated_mlp, conv_bn_act) "
                         "contains SUBSTRING")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    ap.add_argument("--json", action="store_true", help="print a JSON list, one object per configuration")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker_main()
    problem = toolchain_problem()
    if problem:
        print(f"fusedrc.inspect: {problem}", file=sys.stderr)
        return 2

    def progress(done, total, answer):
        if not args.json and sys.stderr.isatty():
            print(f"\r{done}/{total} compiled", end="" if done < total else "\n", file=sys.stderr, flush=True)

    report = inspect_kernels(args.arch, args.kernel, max(1, args.jobs), progress)
    if args.kernel is not None and not report.results and not report.failures:
        names = sorted({n for s in discover_specs(args.arch)[0] for n in _names(s)})
        print(f"fusedrc.inspect: --kernel {args.kernel!r} matches no kernel; expected a substring of one "
              f"of {names}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.results, indent=1))
    else:
        print(format_table(report))
    for f in report.failures:
        what = f.get("module") and f"module {f['module']}" or \
            f"{f['kernel']} {f['arch']} {f['dtype']} {_config_text(f['config'])}"
        print(f"FAILED {what}:\n{f['error']}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
