"""Command line: ``fusedrc-bench [options]``, ``fusedrc-bench kernels [options]``, ``fusedrc-bench plot FILE``."""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

_SUBCOMMANDS = ("kernels", "plot")
_DTYPES = ("float32", "bfloat16", "float16")
QUICK_COMPILE_REASON = ("--quick leaves torch.compile out: compiling costs about 10 s per configuration "
                        "on a small CPU machine")


def _batch_sizes(text):
    out = []
    for part in text.replace(" ", "").split(","):
        try:
            v = int(part)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(
                f"batch sizes are positive integers separated by commas (e.g. 16,64), got {text!r}")
        out.append(v)
    return out


def _budgets(text):
    out = []
    for part in text.replace(" ", "").split(","):
        try:
            v = float(part)
        except ValueError:
            v = -1.0
        if not 0 < v <= 1:
            raise argparse.ArgumentTypeError(
                f"budgets are fractions in (0, 1] separated by commas (e.g. 0.75,0.5), got {text!r}")
        out.append(v)
    return out


WORKLOAD_SETS = {"all": ("ffn", "resnet"), "models": ("resnet50", "opt")}


def _common(p, quick_help):
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when present, else CPU (default auto)")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration first")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--results-dir", default="benchmarks/results", help="where the JSON and CSV go "
                   "(default benchmarks/results)")
    p.add_argument("--plots-dir", default="plots", help="where the PNG plots go (default plots)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def sweep_parser():
    p = argparse.ArgumentParser(
        prog="fusedrc-bench",
        description="Memory-vs-speed curves of activation recomputation: no recompute, torch.utils.checkpoint, "
                    "fusedrc and torch.compile(activation_memory_budget) on the same model and batch. "
                    "Knob: the fraction of blocks recomputed (0, 1/4, 1/2, 3/4, 1) and the batch size; "
                    "for the real models (--workload resnet50/efficientnet_b0/densenet121/opt/mixtral/bert/models) the policy and "
                    "memory_budget "
                    "of fusedrc.convert.",
        epilog="subcommands: 'fusedrc-bench kernels [options]' (per-kernel microbenchmarks), "
               "'fusedrc-bench plot RESULTS.json [--plots-dir DIR]' (redraw plots from a result file)")
    p.add_argument("--workload", choices=("ffn", "resnet", "resnet50", "efficientnet_b0", "densenet121", "opt", "mixtral",
                                          "bert", "all", "models"),
                   default="all",
                   help="all (default): the synthetic ffn and resnet; models: the real models resnet50 "
                        "(torchvision ResNet-50, weights=None) and opt (Hugging Face OPTForCausalLM, small "
                        "config); efficientnet_b0 (torchvision, weights=None: depthwise convs, SiLU), densenet121 (torchvision, "
                        "weights=None: pre-activation BN-ReLU-Conv units) and mixtral "
                        "(Hugging Face MixtralForCausalLM, small config: routed experts) and bert (Hugging Face "
                        "BertForMaskedLM, small config: an FFN split over two modules) by name; "
                        "all built from code, no downloads. The real models are opt-in (about 1-2 "
                        "minutes each on 2 CPU cores): their strategies are the original, "
                        "torch.utils.checkpoint on the units fusedrc.convert fuses and on whole blocks, "
                        "fusedrc.convert(policy='all'/'blocks') and convert(memory_budget=b)")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=None,
                   help="comma-separated batch sizes for every workload (default: per workload and device)")
    p.add_argument("--budgets", type=_budgets, default=None,
                   help="real models: comma-separated memory_budget fractions for fusedrc.convert "
                        "(default: resnet50 0.8,0.6,0.45; efficientnet_b0 0.8,0.5,0.3; densenet121 0.7,0.4,0.25; "
                        "opt 0.75,0.5,0.35; "
                        "mixtral 0.6,0.4,0.25; bert 0.75,0.5,0.35)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--channels-last", action="store_true",
                   help="image workloads (resnet, resnet50, efficientnet_b0, densenet121): model and input in channels_last, "
                        "the layout "
                        "cuDNN and the Triton conv kernels are fastest in on a GPU")
    _common(p, "tiny shapes, 3 repeats, no torch.compile: under a minute on 2 CPU cores (the CI smoke run)")
    return p


def kernels_parser():
    p = argparse.ArgumentParser(
        prog="fusedrc-bench kernels",
        description="Per-kernel microbenchmarks (forward + backward): fusedrc's fused op vs eager (unfused) vs "
                    "torch.utils.checkpoint for linear_act, fused_mlp(_dropout), (norm_)gated_mlp, moe_experts, mix_ffn, "
                    "xielu_mlp, "
                    "conv_bn_act and "
                    "bn_act_conv; achieved TFLOP/s counts "
                    "the recompute.")
    _common(p, "tiny shapes, 3 repeats")
    return p


def plot_parser():
    p = argparse.ArgumentParser(prog="fusedrc-bench plot", description="Redraw the plots from a result file alone.")
    p.add_argument("results", metavar="RESULTS.json", help="a JSON file written by fusedrc-bench")
    p.add_argument("--plots-dir", default="plots", help="default plots")
    return p


def _resolve(p, args):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False); "
                "use --device cpu or auto")
    dev = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                       else "cpu")
    if args.dtype is None:
        args.dtype = "bfloat16" if dev.type == "cuda" else "float32"
    from . import measure

    measure.match_fp32_precision(dev)
    for flag in ("results_dir", "plots_dir"):  # checked before the run, not after it
        d = getattr(args, flag, None)
        if d is not None:
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                p.error(f"--{flag.replace('_', '-')}: cannot create directory {d!r} ({e.strerror})")
            if not os.access(d, os.W_OK):
                p.error(f"--{flag.replace('_', '-')}: directory {d!r} is not writable")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {args.warmup}")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats: must be >= 1, got {args.repeats}")
    if args.warmup is None:
        args.warmup = 1 if dev.type == "cpu" else 5
    if args.repeats is None:
        args.repeats = 3 if args.quick else (7 if dev.type == "cpu" else 20)
    return dev, getattr(torch, args.dtype)


def _header(kind, args, dev, backend, t_start, notes, skipped):
    from . import measure

    commit, dirty = measure.git_info()
    return {
        "schema": "fusedrc-bench/1", "kind": kind,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["fusedrc-bench", *args.argv]), "elapsed_s": time.perf_counter() - t_start,
        "quick": bool(args.quick), "git_commit": commit, "git_dirty": dirty,
        "device": measure.device_info(dev), "versions": measure.versions(),
        "loadavg": {"start": args.load_start, "end": measure.loadavg()},
        "dtype": args.dtype, "fusedrc_backend": backend,
        "timer": "cuda_events" if dev.type == "cuda" else "time.perf_counter",
        "warmup": args.warmup, "repeats": args.repeats, "notes": notes, "skipped": skipped,
        # the kernels' switches set from the environment (FUSEDRC_GROUPED_EXPERTS, FUSEDRC_DIRECT_LAUNCH, ...)
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FUSEDRC_")},
    }


def _finish(doc, args, t_start):
    from . import plot, results

    doc["elapsed_s"] = time.perf_counter() - t_start
    js, cs = results.write(doc, args.results_dir)
    pngs = plot.plot(doc, args.plots_dir)
    print(f"wrote {js}\nwrote {cs}")
    for p in pngs:
        print(f"wrote {p}")
    load = doc["loadavg"]["end"]
    if load and load[0] > doc["device"]["torch_threads"] + 0.75:
        print(f"note: load average {load[0]:.2f}: other processes shared the cores, the timings are noisy")
    print(f"done in {doc['elapsed_s']:.1f} s")
    return doc


def _fmt_mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def run_sweep(argv):
    p = sweep_parser()
    args = p.parse_args(argv)
    args.argv = list(argv)
    dev, dtype = _resolve(p, args)
    t_start = time.perf_counter()
    import torch

    import fusedrc

    from . import measure, strategies, sweep, workloads

    from . import models

    names = list(WORKLOAD_SETS.get(args.workload, (args.workload,)))
    for n in names:
        if n in models.MODEL_WORKLOADS and (why := models.require(n)):
            p.error(f"--workload {args.workload}: {why}")
    args.load_start = measure.loadavg()
    synthetic = [n for n in names if n not in models.MODEL_WORKLOADS]
    real = [n for n in names if n in models.MODEL_WORKLOADS]
    if args.budgets and not real:
        p.error(f"--budgets applies to the real-model workloads ({', '.join(models.MODEL_WORKLOADS)}); "
                f"--workload {args.workload} has none")
    backend = sweep.backend_for(dev)
    notes, skipped = [], []
    compile_reason = None
    if args.no_compile:
        compile_reason = "--no-compile"
    elif args.quick:
        compile_reason = QUICK_COMPILE_REASON
    if compile_reason:
        print(f"torch.compile skipped: {compile_reason}", flush=True)
    default_budgets = models.QUICK_BUDGETS if args.quick else models.BUDGETS
    settings = {
        "workloads": names, "quick": args.quick, "warmup": args.warmup, "repeats": args.repeats,
        "batch_sizes": {n: (args.batch_sizes or workloads.default_batch_sizes(n, dev.type, args.quick))
                        for n in names},
        "fractions": list(strategies.FRACTIONS),
        "budgets": {n: list(args.budgets or default_budgets[n]) for n in real},
        "channels_last": args.channels_last,
    }
    if not synthetic and not compile_reason:
        compile_reason = "the real-model workloads compare fusedrc.convert with torch.utils.checkpoint only"
    plans = {n: (strategies.compile_plan(n, dev.type, settings["batch_sizes"][n]) if n in synthetic else ([], []))
             for n in names}
    settings["compile_budgets"] = {n: (plans[n][0] if not compile_reason else []) for n in names}
    settings["compile_batch_sizes"] = {n: (plans[n][1] if not compile_reason else []) for n in names}
    if not compile_reason and dev.type == "cpu":
        notes.append("CPU: torch.compile runs at the largest batch size only (compiling costs 10-40 s per "
                     "configuration here), budgets " + "; ".join(f"{n}: {plans[n][0]}" for n in synthetic))
    if real and synthetic and not compile_reason:
        notes.append("torch.compile is not run on the real models (" + ", ".join(real) + ")")
    if not compile_reason:
        notes.append("torch.compile configurations run after every eager one: inductor's compiled CPU code "
                     "brings OpenMP threads that slowed later eager steps several-fold on a 2-core machine")
    info = measure.device_info(dev)
    print(f"fusedrc-bench: {', '.join(names)} on {info['name']} ({dev.type}), {args.dtype}, fusedrc backend "
          f"{backend}, torch {torch.__version__}; warm-up {args.warmup}, repeats {args.repeats}", flush=True)
    if synthetic:
        notes.append("step = zero_grad + forward + mean(out^2) + backward + SGD.step; eager configurations of "
                     "one (workload, batch size) are timed in interleaved rounds, torch.compile ones one after "
                     "another")
    if real:
        notes.append("real models (" + ", ".join(real) + "): one copy of the same initial weights per strategy; "
                     "step = zero_grad + forward + loss (image models: cross-entropy on random labels; opt: causal-LM "
                     "cross-entropy) + backward + SGD.step + zero_grad (gradients freed); the strategies of one "
                     "(workload, batch size) are timed in interleaved rounds. torch_checkpoint = "
                     "torch.utils.checkpoint(use_reentrant=False) on exactly the units fusedrc.convert fuses; "
                     "torch_checkpoint_blocks = on each block convert(policy='blocks') recomputes (Bottleneck, "
                     "MBConv, OPTDecoderLayer); convert_budget knob = the memory_budget fraction passed to convert, "
                     "planned on the timed batch; convert counts activation bytes its own way (saved views of "
                     "weights such as a Linear's weight.t() included, which saved_activation_bytes leaves "
                     "out): plan_baseline_bytes / plan_final_bytes are its counts; convert_s = time "
                     "fusedrc.convert took, budget planning included")
    notes.append("memory: saved_activation_bytes = the storages autograd's saved tensors keep alive during the "
                 "forward, each counted once at its size (saved-tensor hooks, parameters and views of them "
                 "excluded); peak_allocated_bytes = torch.cuda.max_memory_allocated over one step (CUDA only; "
                 "ratios and plots use peak_allocated_bytes - allocated_before_step_bytes: other workloads and "
                 "model copies share the GPU)")
    if dev.type == "cpu":
        notes.append("CPU: fusedrc runs its reference backend (pure PyTorch); its GPU advantage comes from the "
                     "Triton kernels, so parity with torch.utils.checkpoint is the CPU expectation")
    # a `timeout` (benchmarks/gpu_session.sh) or Ctrl-C still writes what was measured
    prev_handler = measure.interrupt_on_sigterm()
    infos, records, complete = {}, [], False
    try:
        with fusedrc.use_backend(backend):  # thread-local, restored afterwards
            infos, records, compile_reason = sweep.run(settings, dev, dtype, compile_reason,
                                                       progress=not args.no_progress, skipped=skipped,
                                                       infos=infos, records=records)
        complete = True
    except KeyboardInterrupt:
        print("interrupted: writing the configurations measured so far", flush=True)
        notes.append("interrupted (SIGTERM or Ctrl-C) before the end: the configurations measured so far")
        compile_reason = compile_reason or "interrupted"
        if not records:
            raise SystemExit("interrupted before any configuration was measured: nothing written")
    finally:
        signal.signal(signal.SIGTERM, prev_handler)
    for s in skipped:
        print(f"skipped {s['what']}: {s['reason']}", flush=True)
    if compile_reason:
        skipped.append({"what": "torch_compile", "reason": compile_reason})
        if not (args.no_compile or args.quick):
            print(f"torch.compile skipped: {compile_reason}", flush=True)
            settings["compile_budgets"] = {n: [] for n in names}
            settings["compile_batch_sizes"] = {n: [] for n in names}
    doc = _header("sweep", args, dev, backend, t_start, notes, skipped)
    doc["settings"] = {k: settings[k] for k in ("workloads", "batch_sizes", "fractions", "compile_budgets",
                                                 "compile_batch_sizes", "budgets", "channels_last")}
    doc["workloads"] = infos
    doc["complete"] = complete
    doc["configs"] = records
    doc["ratios"] = sweep.ratios(records)
    doc["model_ratios"] = sweep.model_ratios(records)
    _print_sweep(doc)
    return _finish(doc, args, t_start)


def _print_sweep(doc):
    from . import results
    from .plot import SHORT

    base = {}
    for c in doc["configs"]:
        if c["strategy"] == "no_recompute":
            base[c["workload"], c["batch_size"]] = c["median_s"]
    print()
    print(f"{'workload':>8} {'batch':>6} {'strategy':>24} {'knob':>6} {'median ms':>10} {'p20-p80 ms':>15} "
          f"{'vs none':>8} {'saved MiB':>10} {'step peak MiB':>13}")
    for c in doc["configs"]:
        knob = f"{c['knob']:g}" if c["knob_name"] == "recompute_fraction" else f"b={c['knob']:g}"
        print(f"{c['workload']:>8} {c['batch_size']:>6} {SHORT[c['strategy']][:24]:>24} {knob:>6} "
              f"{c['median_s'] * 1e3:10.1f} {c['p20_s'] * 1e3:7.1f}-{c['p80_s'] * 1e3:<7.1f} "
              f"{c['median_s'] / base[c['workload'], c['batch_size']]:8.3f} "
              f"{_fmt_mib(c['saved_activation_bytes']):>10} {_fmt_mib(results.own_peak(c)):>13}")
    print()
    for r in doc["ratios"]:
        print(f"{r['workload']} batch {r['batch_size']}, all blocks recomputed: step time fusedrc/checkpoint "
              f"{r['time_fusedrc_over_checkpoint']:.3f}, fusedrc/none {r['time_fusedrc_over_no_recompute']:.3f}, "
              f"checkpoint/none {r['time_checkpoint_over_no_recompute']:.3f}; activation memory fusedrc/none "
              f"{r['saved_fusedrc_over_no_recompute']:.3f}, checkpoint/none "
              f"{r['saved_checkpoint_over_no_recompute']:.3f}")
    for r in doc.get("model_ratios", []):
        ck = SHORT[r["checkpoint_strategy"]]
        knob = f" b={r['knob']:g}" if r["knob_name"] == "memory_budget" else ""
        print(f"{r['workload']} batch {r['batch_size']}, {SHORT[r['strategy']]}{knob}: step time /original "
              f"{r['time_over_no_recompute']:.3f}, /{ck} {r['time_over_checkpoint']:.3f}; activation bytes "
              f"/original {r['saved_over_no_recompute']:.3f}, /{ck} {r['saved_over_checkpoint']:.3f}")


def run_kernels(argv):
    p = kernels_parser()
    args = p.parse_args(argv)
    args.argv = ["kernels", *argv]
    dev, dtype = _resolve(p, args)
    t_start = time.perf_counter()
    import fusedrc

    from . import kernels, measure, sweep

    args.load_start = measure.loadavg()
    backend = sweep.backend_for(dev)
    notes, skipped = [], []
    if dev.type == "cpu":
        notes.append(kernels.CPU_NOTE)
        skipped.append({"what": "triton kernels", "reason": kernels.CPU_NOTE})
        print(f"note: {kernels.CPU_NOTE}")
    else:
        notes.append("GPU: fused ops run the Triton kernels; timed with triton.testing.do_bench "
                     "(warmup/repeats options unused)")
    # a `timeout` (benchmarks/gpu_session.sh) or Ctrl-C still writes what was measured
    prev_handler = measure.interrupt_on_sigterm()
    try:
        with fusedrc.use_backend(backend):
            records, gemm, complete = kernels.run(dev, dtype, args.quick, args.warmup, args.repeats, backend,
                                                  progress=not args.no_progress)
    finally:
        signal.signal(signal.SIGTERM, prev_handler)
    if not complete:
        notes.append("interrupted (SIGTERM or Ctrl-C) before the end: the patterns timed so far")
    doc = _header("kernels", args, dev, backend, t_start, notes, skipped)
    doc["complete"] = complete
    if dev.type == "cuda":
        doc["timer"] = "triton.testing.do_bench"
    doc["gemm_rate"] = gemm
    doc["configs"] = records
    print()
    print(f"GEMM rate ({'x'.join(map(str, gemm['shape']))} matmul): {gemm['tflops']:.3f} TFLOP/s")
    print(f"{'pattern':>17} {'strategy':>17} {'median ms':>10} {'p20-p80 ms':>15} {'GEMMs':>6} {'TFLOP/s':>8} "
          f"{'saved MiB':>10}")
    for c in records:
        print(f"{c['pattern']:>17} {c['strategy']:>17} {c['median_s'] * 1e3:10.2f} "
              f"{c['p20_s'] * 1e3:7.2f}-{c['p80_s'] * 1e3:<7.2f} {c['gemm_units']:>6g} {c['tflops']:8.3f} "
              f"{_fmt_mib(c['saved_activation_bytes']):>10}")
    return _finish(doc, args, t_start)


def run_plot(argv):
    p = plot_parser()
    args = p.parse_args(argv)
    from . import plot, results, schema

    try:
        doc = results.load(args.results)
    except FileNotFoundError as e:
        p.error(f"RESULTS.json: {e}")
    except (ValueError, schema.SchemaError) as e:
        p.error(f"RESULTS.json: {args.results} is not a fusedrc-bench result file: {e}")
    for path in plot.plot(doc, args.plots_dir):
        print(f"wrote {path}")
    return doc


def main(argv=None):
    """Entry point of ``fusedrc-bench`` / ``python -m fusedrc.bench``.

    ``fusedrc-bench [options]`` runs the memory-vs-speed sweep, ``fusedrc-bench kernels``
    the per-kernel microbenchmarks, ``fusedrc-bench plot RESULTS.json`` redraws plots.
    ``argv`` defaults to ``sys.argv[1:]``; returns the exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        run_plot(argv[1:])
    elif argv and argv[0] == "kernels":
        run_kernels(argv[1:])
    else:
        if argv and not argv[0].startswith("-"):
            sweep_parser().error(f"unknown subcommand {argv[0]!r}: choose from {', '.join(_SUBCOMMANDS)} "
                                 "(or no subcommand for the sweep)")
        run_sweep(argv)
    return 0
