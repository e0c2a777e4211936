"""Tile sweep on a GPU: candidate table entries for the dense and conv kernels, one JSON file.

The tile tables (fusedrc/kernels/_common.py ``_TABLE``, fusedrc/kernels/conv_bn_act.py ``_TABLE``) are never
autotuned at run time: the forward and the backward recompute must read the same entry. This
script is how entries are chosen offline (issues 3 and 4):

- dense: for each of issue 3's GEMM shapes, every candidate ``GemmConfig`` (some also with TMA
  loads, ``GEMM_TMA``, or launched persistent, ``GEMM_PERSISTENT``) runs the forward
  kernel (``gemm_act``, bias + ReLU epilogue) and the recompute kernel (``gemm_act_grad``,
  bias, ReLU, incoming gradient, bias-gradient partials), checked against torch first, timed
  against cuBLAS (``torch.addmm`` + ReLU, and the same GEMM alone);
- gated: for Llama-2 7B's MLP on 8192 tokens, candidate tiles of the gated FFN's dual kernels
  (``gated_act``: gate and up in one main loop; ``gated_act_grad``: their recompute), checked
  against torch, timed against cuBLAS running the two GEMMs (the table's choice is
  ``gated_config``: the dense entry with BLOCK_N halved, or taken whole where this sweep found it faster);
- conv: for ResNet-50 conv+BN+ReLU shapes at batch 256, every candidate ``ConvConfig``
  replaces the sm_90 16-bit table entries and a fused training step
  (``fusedrc.recompute`` of the layer, forward + backward) is checked against eager and timed.

- ffn: the dense patterns' training steps (issue 3's two FFNs, a gated MLP, routed experts; shapes
  as ``fusedrc-bench kernels``, whose cases it runs) under each launch switch of the dense
  kernels (one program per tile / persistent; and pointer / TMA loads for the dense FFN), against eager and
  ``torch.utils.checkpoint``: the ratios issue 3's targets are stated in.

Every raw timing goes into the JSON with the device, versions and commit.

    python benchmarks/gpu_tile_sweep.py --out results/            # both, bf16
    python benchmarks/gpu_tile_sweep.py --only dense --dtype float16
    python benchmarks/gpu_tile_sweep.py --static                  # no GPU: registers/spills/smem

``--static`` needs no GPU: it compiles every candidate for sm_90 ahead of time (as
``python -m fusedrc.inspect`` compiles the table) and reports registers, shared memory, spills
and the MMA instruction, so that candidates which spill or do not fit can be dropped before a
GPU is spent on them (run it without TRITON_INTERPRET).
"""
from __future__ import annotations

import argparse
import importlib

import torch

import fusedrc
from fusedrc.bench import measure
from gpu_conv_tradeoff import conv_layer  # benchmarks/ is on the path when a script runs

# (M, K, N) of issue 3's GEMMs: Linear+ReLU 8192x4096->16384, the FFN at d=4096/h=16384 on
# 8192 tokens (its two GEMMs) and at d=1024/h=4096 on 16384 tokens
DENSE_SHAPES = [(8192, 4096, 16384), (8192, 16384, 4096), (16384, 1024, 4096), (16384, 4096, 1024)]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, EPILOGUE_SPLIT]); shared memory
# per stage is (BM + BN) * BK * 2 bytes: 128x256x64 is 48 KiB, so 4 stages fit sm_90's 227 KiB
DENSE_CANDIDATES = [
    # first (the table's entry runs before all): the sm_90 large entry before 2026-11-28, and the
    # spilling 256x128 that beat it on 2026-11-27
    (128, 128, 64, 8, 8, 4, 4), (256, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 4, 5),
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 4),
    (128, 64, 64, 8, 4, 4), (64, 256, 64, 8, 4, 4), (128, 128, 128, 8, 8, 2), (128, 256, 32, 8, 8, 5),
    # no spills on sm_90 in the --static report (128x256 / 256x128 spill ~1 KiB in the grad kernel)
    (128, 128, 64, 8, 8, 5), (128, 128, 64, 16, 8, 4), (128, 128, 128, 8, 8, 3), (128, 64, 64, 8, 4, 5),
    # the grad kernel's epilogue in quarters: 128x128 on 8 warps in 128 registers (2 CTAs per SM
    # where shared memory allows: 3 stages), 128x256 / 256x128 down to ~40 bytes of spill
    (128, 128, 64, 8, 8, 3, 4), (128, 128, 64, 8, 8, 5, 4), (128, 128, 128, 8, 8, 3, 4),
    (128, 256, 64, 8, 8, 3, 4), (256, 128, 64, 8, 8, 3, 4), (128, 64, 64, 8, 4, 4, 4),
    # in eighths, the forward's activation per slice too: 256x128 without spills (the sm_90 large
    # entry since 2026-11-28, untimed; unsplit, at the top of this list, its grad kernel ran at 90%
    # of cuBLAS while spilling), and 128x256 beside it
    (256, 128, 64, 8, 8, 3, 8), (256, 128, 64, 8, 8, 4, 8), (128, 256, 64, 8, 8, 3, 8),
]
# also timed with TMA loads (fusedrc/kernels/_common.py GEMM_TMA): the table's entries and the large tiles
# the pointer loads cannot hold without spilling
TMA_CANDIDATES = [(128, 128, 64, 8, 8, 3, 4), (128, 128, 64, 8, 8, 4, 4), (128, 256, 64, 8, 8, 3, 4),
                  (128, 256, 64, 8, 8, 4, 4), (256, 128, 64, 8, 8, 3, 4), (128, 128, 128, 8, 8, 3, 4),
                  (256, 128, 64, 8, 8, 3, 8)]
# also timed persistent (fusedrc/kernels/_common.py GEMM_PERSISTENT=1: one program per SM walking the
# tiles, each tile's epilogue overlapping the next tile's loads), with TMA loads or not. The
# --static report (sm_90, bf16): no spills at 128x128 (forward ~190 registers, grad 165 with TMA,
# ~240 without: one CTA per SM either way), 80-460 bytes at 128x256
# (wide tiles, 128x256 and 256x128 on 8 warps, are never launched persistent: _common._wide_tile)
PERSISTENT_CANDIDATES = [((128, 128, 64, 8, 8, 4, 4), False), ((128, 128, 64, 8, 8, 3, 4), False),
                         ((128, 128, 64, 8, 8, 4, 4), True), ((128, 128, 64, 8, 8, 3, 4), True),
                         ((128, 128, 128, 8, 8, 3, 4), True)]
# (M, K, H) of the gated FFN's dual GEMMs: Llama-2 7B, 8192 tokens; and a smaller model's
GATED_SHAPES = [(8192, 4096, 11008), (16384, 2048, 5632)]
# two fp32 accumulators: a BLOCK_M x BLOCK_N dual tile holds what a BLOCK_M x 2*BLOCK_N one does
GATED_CANDIDATES = [
    (128, 64, 64, 8, 8, 3), (128, 64, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4), (128, 64, 32, 8, 8, 5), (256, 64, 64, 8, 8, 3), (64, 64, 64, 8, 4, 4),
    # the grad kernel's epilogue in halves / quarters: 128x128 without its 496-byte spill (254 / 244 registers)
    (128, 128, 64, 8, 8, 3, 2), (128, 128, 64, 8, 8, 3, 4), (128, 128, 64, 8, 8, 4, 4), (256, 64, 64, 8, 8, 3, 2),
]
GATED_PERSISTENT_CANDIDATES = [(128, 64, 64, 8, 8, 4), (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3, 4)]
# (C_in, C_out, kernel, stride, H=W) of ResNet-50 layers where the fused conv lags most
CONV_SHAPES = [(64, 64, 3, 1, 56), (128, 128, 3, 1, 28), (256, 256, 3, 1, 14), (512, 512, 3, 1, 7),
               (256, 64, 1, 1, 56), (1024, 256, 1, 1, 14)]
CONV_CANDIDATES = [
    (128, 64, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4),
    (64, 128, 64, 8, 4, 4), (256, 64, 64, 8, 8, 3), (128, 64, 32, 8, 4, 5), (64, 64, 64, 8, 4, 4),
    # the backward's epilogue in halves / quarters (7th field): 128x64 in <= 128 registers, 128x128
    # without spills
    (128, 64, 64, 8, 8, 4, 4), (128, 64, 64, 8, 8, 3, 4), (128, 128, 64, 8, 8, 3, 4), (128, 128, 64, 8, 8, 3, 2),
]


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _time(fn, rep=100):
    return measure.do_bench_times(fn, rep=rep)


def sweep_dense(dtype, records, first=None):
    """Each of DENSE_SHAPES: cuBLAS, then the table's entry and the candidates (``first``: only the
    first that many of DENSE_CANDIDATES, no TMA or persistent runs)."""
    from fusedrc.kernels import _common

    for M, K, N in DENSE_SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
        b = torch.randn(N, device="cuda", dtype=dtype)
        g = torch.randn(M, N, device="cuda", dtype=dtype)
        bt = w.t()  # (K, N) view: what linear_act hands the kernels
        base = dict(kind="dense", shape=[M, K, N])
        ref_h = torch.addmm(b, a, bt)
        ref_y = torch.relu(ref_h)
        ref_gh = torch.where(ref_h > 0, g, torch.zeros_like(g))
        records.append(dict(base, impl="cublas_addmm_relu", times_s=_time(lambda: torch.relu(torch.addmm(b, a, bt)))))
        records.append(dict(base, impl="cublas_mm", times_s=_time(lambda: torch.mm(a, bt))))
        table = _common.gemm_config(M, N, K, dtype, "ieee", torch.cuda.get_device_capability())
        cands = [_common.GemmConfig(*c) for c in DENSE_CANDIDATES[:first]]
        runs = [(c, False, 0) for c in [table] + [c for c in cands if c != table]]
        if first is None:
            runs += [(_common.GemmConfig(*c), True, 0) for c in TMA_CANDIDATES]
            runs += [(_common.GemmConfig(*c), tma, 1) for c, tma in PERSISTENT_CANDIDATES]
        default = bool(_common.GEMM_TMA), _common.GEMM_PERSISTENT
        for cfg, tma, per_sm in runs:
            rec = dict(base, config=list(cfg), loads="tma" if tma else "pointer", persistent=per_sm,
                       in_table=cfg == table and (tma, per_sm) == default)
            try:
                with measure.switches(_common, GEMM_TMA=tma, GEMM_PERSISTENT=per_sm):
                    assert _common._use_tma(a, bt) is tma
                    y = _common.gemm_act(a, bt, b, "relu", config=cfg)
                    gh, _, db = _common.gemm_act_grad(a, bt, b, g, "relu", config=cfg)
                    rec.update(err_forward=_rel_err(y, ref_y), err_grad=_rel_err(gh, ref_gh),
                               err_dbias=_rel_err(db, ref_gh.float().sum(0)))
                    rec["forward_times_s"] = _time(lambda: _common.gemm_act(a, bt, b, "relu", config=cfg))
                    rec["grad_times_s"] = _time(lambda: _common.gemm_act_grad(a, bt, b, g, "relu", config=cfg))
            except Exception as e:  # out of resources, a compile error: record it and go on
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            records.append(rec)
            _print(rec, records)
        torch.cuda.empty_cache()


# the dense patterns' training steps, as fusedrc-bench kernels runs them (its _Case): issue 3's two
# FFNs (Linear -> GELU -> Linear), Llama-2 7B's gated MLP, Mixtral-8x7B's routed experts
FFN_CASES = [("fused_mlp", dict(M=8192, d=4096, h=16384)), ("fused_mlp", dict(M=16384, d=1024, h=4096)),
             ("gated_mlp", dict(M=8192, d=4096, h=11008)), ("moe_experts", dict(T=8192, d=4096, h=14336, E=8, k=2))]
# the dense kernels' launch switches, (label, GEMM_TMA, GEMM_PERSISTENT), each over the table's tiles
# (the TMA ones on the dense FFN only: the dual kernels have no TMA path)
FFN_VARIANTS = [("default", False, 0), ("tma", True, 0), ("persistent", False, 1), ("persistent_tma", True, 1)]
FFN_REP_MS = 400  # steps of 2-66 ms: enough runs of each for a median


def sweep_ffn(dtype, records, device="cuda", cases=FFN_CASES):
    """Each pattern's step under each launch switch against eager and torch.utils.checkpoint: the
    ratios issue 3's targets are stated in (at checkpoint's bytes: <= 0.95x / 0.85x checkpoint)."""
    from fusedrc.bench.kernels import _Case
    from fusedrc.kernels import _common

    for pattern, shape in cases:
        case = _Case(pattern, shape, torch.device(device), dtype, "triton")
        base = dict(kind="ffn", pattern=pattern, shape=list(shape.values()))
        case.step("eager")
        ref = [case.x.grad.clone()] + [p.grad.clone() for p in case.params]
        for strategy in ("eager", "torch_checkpoint"):
            records.append(dict(base, impl=strategy, times_s=_time(lambda: case.step(strategy), FFN_REP_MS)))
        default = bool(_common.GEMM_TMA), _common.GEMM_PERSISTENT
        for label, tma, per_sm in FFN_VARIANTS:
            if tma and pattern != "fused_mlp":
                continue  # the dual kernels have no TMA path, and the plain GEMMs are cuBLAS's on CUDA
            rec = dict(base, impl="fusedrc", variant=label, in_table=(tma, per_sm) == default)
            try:
                with fusedrc.use_backend("triton"), measure.switches(_common, GEMM_TMA=tma, GEMM_PERSISTENT=per_sm):
                    case.step("fusedrc")
                    got = [case.x.grad] + [p.grad for p in case.params]
                    rec["err_grads"] = max(_rel_err(a, b) for a, b in zip(got, ref))
                    rec["times_s"] = _time(lambda: case.step("fusedrc"), FFN_REP_MS)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            records.append(rec)
            _print(rec, records)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()


def sweep_gated(dtype, records):
    from fusedrc.kernels import _common, gated_mlp

    for M, K, H in GATED_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        wg = torch.randn(H, K, device="cuda", dtype=dtype) / K ** 0.5
        wu = torch.randn(H, K, device="cuda", dtype=dtype) / K ** 0.5
        g = torch.randn(M, H, device="cuda", dtype=dtype)
        base = dict(kind="gated", shape=[M, K, H])
        hg, hu = x @ wg.t(), x @ wu.t()
        ref_a = torch.nn.functional.silu(hg.float()) * hu.float()
        records.append(dict(base, impl="cublas_two_mm", times_s=_time(lambda: (x @ wg.t(), x @ wu.t()))))
        records.append(dict(base, impl="eager_swiglu",
                            times_s=_time(lambda: torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t()))))
        table = gated_mlp._gated_table_config(M, H, K, dtype, "ieee", torch.cuda.get_device_capability())
        cands = [_common.GemmConfig(*c) for c in GATED_CANDIDATES]
        runs = [(c, 0) for c in [table] + [c for c in cands if c != table]]
        runs += [(_common.GemmConfig(*c), 1) for c in GATED_PERSISTENT_CANDIDATES]
        default = _common.GEMM_PERSISTENT
        for cfg, per_sm in runs:
            rec = dict(base, config=list(cfg), persistent=per_sm, in_table=cfg == table and per_sm == default)
            try:
                with measure.switches(_common, GEMM_PERSISTENT=per_sm):
                    a = gated_mlp.gated_act(x, wg, wu, None, None, "silu", config=cfg)
                    _, _, a_bwd, _, _ = gated_mlp.gated_act_grad(x, wg, wu, None, None, g, "silu", config=cfg)
                    rec.update(err_forward=_rel_err(a, ref_a), recompute_bitwise=bool(torch.equal(a, a_bwd)))
                    rec["forward_times_s"] = _time(
                        lambda: gated_mlp.gated_act(x, wg, wu, None, None, "silu", config=cfg))
                    rec["grad_times_s"] = _time(
                        lambda: gated_mlp.gated_act_grad(x, wg, wu, None, None, g, "silu", config=cfg))
            except Exception as e:  # out of resources, a compile error: record it and go on
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            records.append(rec)
            _print(rec, records)
        torch.cuda.empty_cache()


def sweep_conv(dtype, batch, records):
    k = importlib.import_module("fusedrc.kernels.conv_bn_act")
    keys = [("sm90", "16bit", "narrow"), ("sm90", "16bit", "wide")]
    saved = {key: k._TABLE[key] for key in keys}
    try:
        for shape in CONV_SHAPES:
            block, x, _, step = conv_layer(shape, batch, dtype, channels_last=True)
            base = dict(kind="conv", shape=list(shape), batch=batch)
            step(lambda: block(x))
            ref_dx = x.grad.clone()
            records.append(dict(base, impl="eager", times_s=_time(lambda: step(lambda: block(x)))))
            table = saved[keys[0]]
            for cfg in [table] + [c for c in (k.ConvConfig(*c) for c in CONV_CANDIDATES) if c != table]:
                for key in keys:
                    k._TABLE[key] = cfg
                k.clear_launch_plans()  # the layers' plans hold the tile they were built with
                rec = dict(base, config=list(cfg), in_table=cfg == table)
                try:
                    with fusedrc.use_backend("triton"):
                        step(lambda: fusedrc.recompute(block, x))
                        rec["err_dx"] = _rel_err(x.grad, ref_dx)
                        rec["times_s"] = _time(lambda: step(lambda: fusedrc.recompute(block, x)))
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:400]
                records.append(rec)
                _print(rec, records)
            torch.cuda.empty_cache()
    finally:
        k._TABLE.update(saved)
        k.clear_launch_plans()


# the implicit-GEMM conv passes (training: stats, reduce, emit_dz; eval / FWD_RECOMPUTE: apply);
# dX/dW are cuDNN by default
_STATIC_CONV_MODES = {"stats", "apply", "reduce", "emit_dz"}


def _candidate_specs(module, config_cls, key, candidates, kind, keep):
    """``module.inspect_specs()`` with its table swapped for one candidate at a time (at ``key``),
    the specs ``keep`` accepts, each tagged with its kind and candidate."""
    table = module._TABLE
    specs = []
    try:
        for cand in candidates:
            cfg = config_cls(*cand)
            module._TABLE = {key: cfg}
            specs += [dict(sp, kind=kind, candidate=list(cfg)) for sp in module.inspect_specs() if keep(sp)]
    finally:
        module._TABLE = table
    return specs


def _static_specs(dtype):
    """sm_90 compile specs of every candidate, built by the kernels modules' own inspect_specs."""
    from fusedrc.kernels import _common
    from fusedrc.kernels import conv_bn_act as ck
    from fusedrc.kernels import gated_mlp as gm

    key = ("sm90", "16bit", "candidate")
    whole = gm._WHOLE
    try:  # a gated candidate is the dual kernels' tile itself (taken whole, not halved)
        gated = []
        for cand in GATED_CANDIDATES:
            gm._WHOLE = {key: _common.GemmConfig(*cand)}
            gated += _candidate_specs(gm, _common.GemmConfig, key, [cand], "gated",
                                      lambda sp: sp["dtype"] == dtype
                                      and not {"row_scale", "dropout", "persistent"} & set(sp["config"]))
    finally:
        gm._WHOLE = whole
    return (_candidate_specs(_common, _common.GemmConfig, key, DENSE_CANDIDATES,
                             "dense", lambda sp: sp["dtype"] == dtype) + gated
            + _candidate_specs(ck, ck.ConvConfig, ("sm90", "16bit", "wide"), CONV_CANDIDATES, "conv",
                               lambda sp: sp["dtype"] == dtype and sp["gemm"]
                               and sp["config"].get("mode") in _STATIC_CONV_MODES))


def _compile_one(i):
    from fusedrc import inspect as fi

    spec = _SPECS[i]
    try:
        res = fi.compile_spec({k: v for k, v in spec.items() if k not in ("kind", "candidate")})
    except Exception as e:  # out of shared memory, a compile error: that is the answer
        res = {"kernel": spec["kernel"], "error": f"{type(e).__name__}: {e}"[:300]}
    return dict(res, kind=spec["kind"], candidate=spec["candidate"], mode=spec["config"].get("mode", ""),
                loads=spec["config"].get("loads", "pointer"), persistent=bool(spec["config"].get("persistent")))


_SPECS = []


def static_report(dtype, jobs):
    import multiprocessing

    global _SPECS
    _SPECS = _static_specs(dtype)
    ctx = multiprocessing.get_context("fork")  # the workers inherit the specs (JITFunctions do not pickle)
    with ctx.Pool(jobs) as pool:
        results = pool.map(_compile_one, range(len(_SPECS)))
    for r in results:
        if "error" in r:
            print(f"{r['kind']:5s} {str(r['candidate']):28s} {r['kernel']:24s} {r['mode']:8s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['kind']:5s} {str(r['candidate']):28s} {r['loads']:7s} {'p' if r['persistent'] else ' '} "
                  f"{r['kernel']:24s} {r['mode']:8s} "
                  f"regs {r['registers']:3d} "
                  f"smem {r['shared_bytes'] // 1024:4d} KiB  spill {r['spill_bytes']:5d}  {r['mma']}", flush=True)
    return results


def _print(rec, records):
    """One candidate's line, against its shape's reference (cuBLAS for dense, eager for conv)."""
    persistent = f"p{rec['persistent']}" if rec.get("persistent") else ""
    head = f"{rec['kind']:5s} {str(rec['shape']):24s} {str(rec.get('config', '')):28s} {rec.get('loads', ''):7s} {persistent:2s}"
    if "error" in rec:
        print(f"{head} ERROR {rec['error'][:120]}", flush=True)
        return
    med = lambda ts: measure.quantile(ts, 0.5) * 1e3  # noqa: E731
    ref_impl = {"dense": "cublas_addmm_relu", "gated": "cublas_two_mm"}.get(rec["kind"], "eager")
    ref = med(next(r["times_s"] for r in records if r["kind"] == rec["kind"] and r["shape"] == rec["shape"]
                   and r.get("pattern") == rec.get("pattern") and r.get("impl") == ref_impl))
    if rec["kind"] == "ffn":
        t = med(rec["times_s"])
        ckpt = med(next(r["times_s"] for r in records if r["kind"] == "ffn" and r["shape"] == rec["shape"]
                        and r["pattern"] == rec["pattern"] and r.get("impl") == "torch_checkpoint"))
        print(f"ffn   {rec['pattern']:11s} {str(rec['shape']):24s} {rec['variant']:15s} step {t:7.3f} ms (x{t / ref:4.2f} eager, x{t / ckpt:4.2f} checkpoint)  "
              f"err {rec['err_grads']:.1e}{'  [table]' if rec['in_table'] else ''}", flush=True)
        return
    if rec["kind"] in ("dense", "gated"):
        f, gr = med(rec["forward_times_s"]), med(rec["grad_times_s"])
        check = (f"err {rec['err_forward']:.1e}/{rec['err_grad']:.1e}" if rec["kind"] == "dense"
                 else f"err {rec['err_forward']:.1e} bitwise {rec['recompute_bitwise']}")
        body = f"fwd {f:7.3f} ms ({ref / f:5.1%} of cuBLAS)  grad {gr:7.3f} ms ({ref / gr:5.1%})  {check}"
    else:
        t = med(rec["times_s"])
        body = f"step {t:7.3f} ms (x{t / ref:4.2f} eager)  err_dx {rec['err_dx']:.1e}"
    print(f"{head} {body}{'  [table]' if rec['in_table'] else ''}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--batch", type=int, default=256, help="conv batch")
    ap.add_argument("--only", choices=("ffn", "dense", "gated", "conv"))
    ap.add_argument("--first", type=int, default=None, metavar="N",
                    help="dense: the table's entry and the first N candidates of each shape only")
    ap.add_argument("--static", action="store_true", help="no GPU: compile the candidates for sm_90 and report")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compiles with --static")
    args = ap.parse_args()
    from fusedrc.kernels import _common
    from fusedrc.kernels import conv_bn_act as ck

    if args.static:
        results = static_report(getattr(torch, args.dtype), args.jobs)
        name = measure.write_results(args.out, "tile_static_sm90", "tile_static", torch.device("cpu"),
                                     arch="sm_90", dtype=args.dtype, results=results,
                                     dense_config_fields=list(_common.GemmConfig._fields))
        print("wrote", name)
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_tile_sweep.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    torch.backends.cudnn.allow_tf32 = False
    records = []

    measure.interrupt_on_sigterm()  # the session's `timeout`: keep what was measured
    complete = False
    try:
        if args.only in (None, "ffn"):
            sweep_ffn(dtype, records)
        if args.only in (None, "dense"):
            sweep_dense(dtype, records, args.first)
        if args.only in (None, "gated"):
            sweep_gated(dtype, records)
        if args.only in (None, "conv"):
            sweep_conv(dtype, args.batch, records)
        complete = True
    except KeyboardInterrupt:
        print(f"interrupted: writing the {len(records)} records measured so far", flush=True)
    finally:
        name = measure.write_results(
            args.out, "tile_sweep_cuda", "tile_sweep", torch.device("cuda"), dtype=args.dtype, complete=complete,
            dense_config_fields=list(_common.GemmConfig._fields), conv_config_fields=list(ck.ConvConfig._fields),
            dense_shape_fields=["M", "K", "N"], gated_shape_fields=["M", "K", "H"], conv_shape_fields=["C_in", "C_out", "kernel", "stride", "H=W"],
            records=records)
        print("wrote", name)


if __name__ == "__main__":
    main()
