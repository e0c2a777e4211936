"""``python -m fusedrc.inspect --json``: every kernel of every module compiles ahead of
time for sm_90 and sm_80 (on the CPU, no GPU), fits shared memory, spills nothing, and
every fp16/bf16 GEMM uses the warpgroup MMA (HGMMA) on sm_90.

One run of the whole set (a couple of minutes on 2 cores), shared by the tests below.
"""
import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("triton")

from fusedrc import inspect as fi  # noqa: E402  (needs triton)

RESULT_TYPES = {"kernel": str, "arch": str, "dtype": str, "config": dict, "registers": int,
                "shared_bytes": int, "spill_bytes": int, "mma": str, "gemm": bool}
DENSE_KERNELS = {"_gemm_act_kernel", "_gemm_act_grad_kernel"}
GATED_KERNELS = {"_gated_act_kernel", "_gated_act_grad_kernel"}
CONV_KERNELS = {"_conv_bn_fwd_kernel", "_bn_stats_finalize_kernel", "_conv_bn_bwd_kernel",
                "_conv_dx_kernel", "_conv_dw_kernel"}
KERNELS_DIR = Path(__file__).resolve().parents[1] / "fusedrc" / "kernels"


def _jit_kernels_in_source():
    """Names of the @triton.jit functions named *_kernel in fusedrc/kernels/*.py (read statically)."""
    names = set()
    for path in KERNELS_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def _key(r):
    return (r["kernel"], r["arch"], r["dtype"], json.dumps(r["config"], sort_keys=True))


@pytest.fixture(scope="module")
def inspection():
    problem = fi.toolchain_problem()
    if problem:
        pytest.skip(f"no ptxas/cuobjdump to compile and read cubins: {problem}")
    specs, failures = fi.discover_specs()
    assert not failures, failures
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    jobs = max(2, os.cpu_count() or 1)
    proc = subprocess.run([sys.executable, "-m", "fusedrc.inspect", "--json", "--jobs", str(jobs)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return specs, json.loads(proc.stdout)


def test_every_spec_compiled(inspection):
    specs, results = inspection
    assert len(specs) > 0
    assert len(results) == len(specs)
    expected = Counter((s.kernel, s.arch, s.dtype, json.dumps(s.config, sort_keys=True)) for s in specs)
    assert Counter(_key(r) for r in results) == expected
    assert {r["arch"] for r in results} == {"sm_90", "sm_80"}
    kernels = {r["kernel"] for r in results}
    assert DENSE_KERNELS | GATED_KERNELS | CONV_KERNELS <= kernels
    # a new @triton.jit kernel in fusedrc/kernels/ must be added to its module's inspect_specs()
    assert _jit_kernels_in_source() <= kernels
    for name in DENSE_KERNELS | GATED_KERNELS | CONV_KERNELS:
        assert {r["arch"] for r in results if r["kernel"] == name} == {"sm_90", "sm_80"}, name
    for name in ("_gemm_act_kernel", "_conv_bn_fwd_kernel", "_conv_dx_kernel", "_conv_dw_kernel"):
        assert {r["dtype"] for r in results if r["kernel"] == name} == {"float16", "bfloat16", "float32"}, name
    # the backward kernel in each of its launch modes
    assert {r["config"].get("mode") for r in results if r["kernel"] == "_conv_bn_bwd_kernel"} >= {
        "reduce", "emit_dz", "eval", "z_reduce", "z_emit_dz", "z_eval"}
    # sm_90 tensor-core GEMMs also compiled with TMA loads (GEMM_TMA)
    for name in DENSE_KERNELS:
        assert {r["dtype"] for r in results if r["kernel"] == name and r["config"].get("loads") == "tma"} == {
            "float16", "bfloat16", "float32"}, name
        assert {r["arch"] for r in results if r["kernel"] == name and r["config"].get("loads") == "tma"} == {"sm_90"}
    # and launched persistent (GEMM_PERSISTENT): sm_90 bf16, dense with either load, gated
    for name in DENSE_KERNELS | GATED_KERNELS:
        persistent = [r for r in results if r["kernel"] == name and r["config"].get("persistent")]
        assert {(r["arch"], r["dtype"]) for r in persistent} == {("sm_90", "bfloat16")}, name
        if name in DENSE_KERNELS:
            assert {r["config"].get("loads", "pointer") for r in persistent} == {"pointer", "tma"}, name
    # and the passes over a z buffer (buffered strategies, CONV_Z="aten"), elementwise
    fwd_modes = {(r["config"].get("mode"), r["gemm"]) for r in results if r["kernel"] == "_conv_bn_fwd_kernel"}
    assert fwd_modes >= {("stats", True), ("apply", True), ("from_z", False), ("z_stats", False)}
    # the conv passes that apply the activation or its derivative, also with GELU's epilogue (bf16)
    gelu = {(r["kernel"], r["config"]["mode"], r["arch"]) for r in results
            if r["config"].get("activation") == "gelu" and r["dtype"] == "bfloat16"}
    assert gelu == {(k, p + m, a) for a in ("sm_90", "sm_80") for p in ("", "dw_") for k, modes in (
        ("_conv_bn_fwd_kernel", ("apply",)), ("_conv_bn_bwd_kernel", ("reduce", "emit_dz", "eval"))) for m in modes}
    # grouped convs (DIRECT): every conv pass, depthwise in every dtype, a channel multiplier and wider
    # groups in bf16; FMA, no MMA
    conv_modes = {"_conv_bn_fwd_kernel": ("stats", "apply"), "_conv_bn_bwd_kernel": ("reduce", "emit_dz", "eval")}
    direct = [r for r in results if r["config"].get("mode", "").startswith(("dw_", "mult_", "grouped_"))]
    assert {(r["kernel"], r["config"]["mode"], r["arch"], r["dtype"]) for r in direct} == {
        (k, p + m, a, d) for k, modes in conv_modes.items() for m in modes for a in ("sm_90", "sm_80")
        for p, dtypes in (("dw_", ("float16", "bfloat16", "float32")), ("mult_", ("bfloat16",)),
                          ("grouped_", ("bfloat16",))) for d in dtypes}
    assert all(not r["gemm"] and r["mma"] == "none" for r in direct)


def test_record_keys_and_types(inspection):
    _, results = inspection
    for r in results:
        assert tuple(r) == fi.RESULT_KEYS
        for k, t in RESULT_TYPES.items():
            assert type(r[k]) is t, (k, r)
        assert r["arch"] in ("sm_90", "sm_80")
        assert r["dtype"] in ("float16", "bfloat16", "float32"), r
        assert r["mma"] in ("HGMMA", "HMMA", "none"), r
        assert {"num_warps", "num_stages"} <= set(r["config"]), r
        assert r["registers"] > 0 and r["shared_bytes"] >= 0 and r["spill_bytes"] >= 0, r


def test_fits_shared_memory(inspection):
    _, results = inspection
    limit = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
    over = [(r["kernel"], r["arch"], r["dtype"], r["config"], r["shared_bytes"]) for r in results
            if r["shared_bytes"] > limit[r["arch"]]]
    assert not over


def test_no_spills(inspection):
    _, results = inspection
    spills = [(r["kernel"], r["arch"], r["dtype"], r["config"], r["spill_bytes"]) for r in results
              if r["spill_bytes"] != 0]
    assert not spills


def test_hgmma_for_16bit_gemms_on_sm90(inspection):
    _, results = inspection
    gemms = [r for r in results if r["gemm"] and r["arch"] == "sm_90" and r["dtype"] in ("float16", "bfloat16")]
    assert gemms
    assert not [(r["kernel"], r["dtype"], r["config"], r["mma"]) for r in gemms if r["mma"] != "HGMMA"]
    # and tensor cores (HMMA) for the same kernels on sm_80
    assert all(r["mma"] == "HMMA" for r in results
               if r["gemm"] and r["arch"] == "sm_80" and r["dtype"] in ("float16", "bfloat16"))


def test_kernel_filter_matches_kernel_or_module_names(capsys):
    """--kernel takes a substring of a kernel's or its module's name; one matching nothing says
    so and lists the names instead of printing an empty table."""
    by_module, _ = fi.discover_specs(kernel="conv_bn_act")
    by_kernel, _ = fi.discover_specs(kernel="_conv_dw")
    assert by_module and {s.module for s in by_module} == {"conv_bn_act"}
    assert by_kernel and {s.kernel for s in by_kernel} == {"_conv_dw_kernel"}
    for op in ("linear_act", "fused_mlp"):  # the dense kernels live in _common.py, shared by both ops
        assert {s.kernel for s in fi.discover_specs(kernel=op)[0]} == DENSE_KERNELS
    # the gated module's dual kernels and its LoRA dropout's elementwise one
    assert {s.kernel for s in fi.discover_specs(kernel="gated_mlp")[0]} == GATED_KERNELS | {"_lora_dropout_kernel"}
    if fi.toolchain_problem():
        pytest.skip("no ptxas/cuobjdump: main() stops before filtering")
    assert fi.main(["--kernel", "no_such_kernel"]) == 1
    err = capsys.readouterr().err
    assert "matches no kernel" in err and "_gemm_act_kernel" in err and "linear_act" in err


_FP64_SCALARS = r"""
import json
from fusedrc import inspect as fi

specs, failures = fi.discover_specs(arch="sm_90")
assert not failures, failures
done, errors = set(), {}
for spec in specs:
    floats = [n for n, t in spec.raw["signature"].items() if t == "fp32"]
    if not floats or spec.kernel in done:
        continue
    done.add(spec.kernel)
    raw = dict(spec.raw, signature={**spec.raw["signature"], **{n: "fp64" for n in floats}})
    try:
        fi.compile_spec(raw, spec.id)
    except Exception as e:  # noqa: BLE001 - collected and reported
        errors[spec.kernel] = repr(e)[-400:]
print(json.dumps({"kernels": sorted(done), "errors": errors}))
"""


def test_float_scalars_compile_as_fp64():
    """torch.compile (inductor) launches a triton_op's kernels with each Python float typed fp64, not
    fp32 as Triton's own launcher types it; a kernel that hands such a scalar to an fp32-only function
    (``sqrt_rn``) then fails to compile, which only a GPU run of inductor showed (H100, 2026-11-27).
    Every kernel with a float scalar compiles for sm_90 with it typed fp64."""
    if fi.toolchain_problem():
        pytest.skip(f"no ptxas/cuobjdump to compile with: {fi.toolchain_problem()}")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _FP64_SCALARS], capture_output=True, text=True, env=env,
                          timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"_bn_stats_finalize_kernel", "_rms_norm_fwd_kernel", "_gemm_act_kernel"} <= set(report["kernels"])
    assert not report["errors"], report["errors"]
