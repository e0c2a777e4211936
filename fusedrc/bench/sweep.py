"""The sweep: every strategy on the same model and batch, memory and step time per configuration.

Per (workload, batch size): the eager configurations are warmed up, then timed in
interleaved rounds (one step of each configuration per round), so machine noise
hits all of them alike. ``torch.compile`` configurations come after every eager
one and are compiled one at a time (the partitioner reads
``activation_memory_budget`` when it compiles), each warmed up and timed on its own.
The real-model workloads (``models.py``: ResNet-50, OPT) build one model copy per
strategy (``fusedrc.convert`` runs, budget planning included, before the timing)
and are timed the same way; torch.compile is not run on them.
"""
from __future__ import annotations

import time

import torch

from . import measure, models, strategies, workloads
from .results import own_peak, step_peak
from .progress import bar


def _memory(runner, device):
    """Activation bytes autograd keeps during one forward, and the peak of one full step (CUDA)."""
    counter = measure.SavedBytes(runner.model.parameters())
    runner.opt.zero_grad(set_to_none=True)
    with counter:
        out = runner.forward()
    runner.loss(out).backward()
    del out
    runner.opt.zero_grad(set_to_none=True)
    peak, before = measure.peak_allocated(device, runner.step)
    return counter.activation_bytes, peak, before


def _budgets(settings, name, batch):
    if batch not in settings["compile_batch_sizes"].get(name, []):
        return []
    return settings["compile_budgets"].get(name, [])


def run(settings: dict, device: torch.device, dtype: torch.dtype, compile_reason, progress=True, log=print,
        skipped=None, infos=None, records=None):
    """Run the sweep described by ``settings``.

    Returns ``(workload infos, configuration records, compile_reason)``; ``compile_reason`` is None when
    torch.compile ran, else why it was skipped (the check that it works runs only after the eager phase).
    ``infos``/``records``, when given, are filled as measurements complete (one workload and batch size
    at a time): a caller interrupted half-way still holds what was measured.
    Configurations that could not be built (a ``memory_budget`` convert cannot meet) are appended to
    ``skipped`` as ``{"what", "reason"}``.

    Two phases: every eager configuration first, then the torch.compile ones. Code compiled by
    inductor on a CPU brings its own OpenMP threads, whose spin-waiting slowed eager steps measured after
    it several-fold on a 2-core machine; eager timings are therefore taken before anything is compiled.
    """
    timer = measure.Timer(device)
    warmup, repeats = settings["warmup"], settings["repeats"]
    groups = [(n, b) for n in settings["workloads"] for b in settings["batch_sizes"][n]]
    skipped = [] if skipped is None else skipped
    n_eager = sum(_n_eager(settings, n) for n, _ in groups)
    n_compile = 0 if compile_reason else sum(len(_budgets(settings, n, b)) for n, b in groups)
    total = (n_eager + n_compile) * (warmup + repeats + 1)
    pbar = bar(total, "fusedrc-bench", disable=not progress)
    infos = {} if infos is None else infos
    records = [] if records is None else records
    built, pending = {}, []
    try:
        for name in settings["workloads"]:
            if name in models.MODEL_WORKLOADS:
                _run_model(name, device, dtype, settings, timer, pbar, warmup, repeats, skipped, infos, records)
                continue
            wl = built[name] = workloads.build(name, device, dtype, settings["quick"],
                                               channels_last=settings.get("channels_last", False))
            infos[name] = {"description": wl.description, "blocks": wl.n_blocks, "shapes": wl.shapes,
                           "input_shape": list(wl.input_shape),
                           "parameters": sum(p.numel() for p in wl.model.parameters()),
                           "step": "zero_grad + forward + mean(out^2) + backward + SGD.step"}
            for batch in settings["batch_sizes"][name]:
                recs, compiled = _run_group(wl, batch, device, dtype, settings, compile_reason is None, timer,
                                            pbar, warmup, repeats)
                records += recs
                pending += compiled
        if pending:
            pbar.set_postfix_str("checking that torch.compile works")
            compile_reason = measure.compile_support(device)
            if compile_reason:
                pbar.update(len(pending) * (warmup + repeats + 1))
            else:
                for r in pending:
                    records.append(_run_compiled(r, device, timer, pbar, warmup, repeats))
                import torch._dynamo

                torch._dynamo.reset()
    finally:
        pbar.close()
    order = {(n, b): i for i, (n, b) in enumerate(groups)}
    records.sort(key=lambda r: order[r["workload"], r["batch_size"]])
    return infos, records, compile_reason


def _n_eager(settings, name):
    if name in models.MODEL_WORKLOADS:
        return len(models.MODEL_STRATEGIES) - 1 + len(settings["budgets"][name])
    return 1 + 2 * len(settings["fractions"])


def _record(r, m):
    c = r.cfg
    rec = {
        "workload": c.workload, "strategy": c.strategy, "batch_size": c.batch_size,
        "knob_name": c.knob_name, "knob": c.knob, "recomputed_blocks": c.recomputed_blocks,
        "n_blocks": r.wl.n_blocks,
        "times_s": m["times"], **measure.summarize(m["times"]),
        "saved_activation_bytes": m["saved"], "peak_allocated_bytes": m["peak"],
        "allocated_before_step_bytes": m["before"], "compile_s": m["compile_s"],
    }
    if isinstance(c, models.ModelConfig):
        rec.update(recomputed_units=c.recomputed_units, n_units=r.wl.n_units, convert_s=c.convert_s,
                   plan_baseline_bytes=c.plan_baseline_bytes, plan_final_bytes=c.plan_final_bytes)
    return rec


def _time(runners, device, timer, pbar, warmup, repeats):
    """Saved bytes and peak of each runner, then warm-up and timed steps in interleaved rounds."""
    out = {}
    for r in runners:
        saved, peak, before = _memory(r, device)
        out[id(r)] = dict(saved=saved, peak=peak, before=before, times=[], compile_s=None)
        pbar.update(1)
    for _ in range(warmup):
        for r in runners:
            r.step()
            pbar.update(1)
    for _ in range(repeats):  # interleaved rounds
        for r in runners:
            out[id(r)]["times"].append(timer(r.step))
            pbar.update(1)
    return [_record(r, out[id(r)]) for r in runners]


def _run_model(name, device, dtype, settings, timer, pbar, warmup, repeats, skipped, infos, records):
    """A real model (``models.py``): build, convert, time every strategy at each batch size, adding
    to ``records`` batch size by batch size (and the model's entry to ``infos`` once built)."""
    pbar.set_postfix_str(f"{name}: building")
    wl = models.build(name, device, dtype, settings["quick"], channels_last=settings.get("channels_last", False))
    for batch in settings["batch_sizes"][name]:
        pbar.set_postfix_str(f"{name} batch {batch}: fusedrc.convert (budget planning)")
        n_skipped = len(skipped)
        runners = models.runners_for(wl, batch, device, dtype, settings["budgets"][name], skipped)
        pbar.update((len(skipped) - n_skipped) * (warmup + repeats + 1))  # budgets convert could not meet
        pbar.set_postfix_str(f"{name} batch {batch}")
        recs = _time(runners, device, timer, pbar, warmup, repeats)
        del runners
        # after convert has run (units, plan_info), and before the records: none without its model's entry
        infos[name] = {
            "description": wl.description, "blocks": wl.n_blocks, "units": wl.n_units, "shapes": wl.shapes,
            "input_shape": list(wl.make_batch(1, "cpu", torch.float32)[0][0].shape[1:]),
            "parameters": sum(p.numel() for p in wl.model.parameters()),
            "step": f"zero_grad + forward + {wl.loss_desc} + backward + SGD.step", "model": True,
            "budgets": list(settings["budgets"][name]), **wl.plan_info}  # unit_names, block_names, ...
        records += recs


def _run_group(wl, batch, device, dtype, settings, compile_ok, timer, pbar, warmup, repeats):
    """Time the eager configurations of one (workload, batch size); return them and the compile runners."""
    x = wl.make_input(batch, device, dtype)
    opt = strategies.make_optimizer(wl)
    cfgs = strategies.configs_for(wl, batch, compile_ok, settings["fractions"], _budgets(settings, wl.name, batch))
    runners = [strategies.Runner(wl, c, x, opt) for c in cfgs]
    eager = [r for r in runners if r.cfg.strategy != "torch_compile"]
    compiled = [r for r in runners if r.cfg.strategy == "torch_compile"]
    pbar.set_postfix_str(f"{wl.name} batch {batch}")
    return _time(eager, device, timer, pbar, warmup, repeats), compiled


def _run_compiled(r, device, timer, pbar, warmup, repeats):
    pbar.set_postfix_str(f"{r.wl.name} batch {r.cfg.batch_size} compiling (budget {r.cfg.knob:g})")
    t0 = time.perf_counter()
    r.compile()
    compile_s = time.perf_counter() - t0
    saved, peak, before = _memory(r, device)
    m = dict(saved=saved, peak=peak, before=before, times=[], compile_s=compile_s)
    pbar.update(1)
    for _ in range(warmup):
        r.step()
        pbar.update(1)
    for _ in range(repeats):
        m["times"].append(timer(r.step))
        pbar.update(1)
    r.compiled = None
    return _record(r, m)


def ratios(records):
    """Per workload and batch size, at full recompute (fraction 1): step-time and memory ratios."""
    out = []
    groups = {}
    for r in records:
        groups.setdefault((r["workload"], r["batch_size"]), []).append(r)
    for (w, b), rs in groups.items():
        def pick(strategy, knob):
            for r in rs:
                if r["strategy"] == strategy and r["knob"] == knob:
                    return r
            return None

        none, ck, fr = pick("no_recompute", 0.0), pick("torch_checkpoint", 1.0), pick("fusedrc", 1.0)
        if not (none and ck and fr):
            continue
        row = {"workload": w, "batch_size": b,
               "time_fusedrc_over_checkpoint": fr["median_s"] / ck["median_s"],
               "time_fusedrc_over_no_recompute": fr["median_s"] / none["median_s"],
               "time_checkpoint_over_no_recompute": ck["median_s"] / none["median_s"],
               "saved_fusedrc_over_checkpoint": fr["saved_activation_bytes"] / max(ck["saved_activation_bytes"], 1),
               "saved_fusedrc_over_no_recompute":
                   fr["saved_activation_bytes"] / max(none["saved_activation_bytes"], 1),
               "saved_checkpoint_over_no_recompute":
                   ck["saved_activation_bytes"] / max(none["saved_activation_bytes"], 1)}
        if none["peak_allocated_bytes"]:
            # each strategy's own step: the peak above what was resident before it (other
            # workloads' weights and gradients share the GPU during the sweep)
            row["peak_fusedrc_over_checkpoint"] = _own_peak(fr) / _own_peak(ck)
            row["peak_fusedrc_over_no_recompute"] = _own_peak(fr) / _own_peak(none)
        out.append(row)
    return out


def _own_peak(r):
    return max(own_peak(r), 1)


CHECKPOINT_OF = {"convert_all": "torch_checkpoint", "convert_budget": "torch_checkpoint",
                 "convert_blocks": "torch_checkpoint_blocks"}


def model_ratios(records):
    """Real models: each fusedrc.convert configuration against the original and against
    torch.utils.checkpoint at the same granularity (policy 'blocks': checkpoint on each block; 'all' and
    budgets: checkpoint on the units convert fuses)."""
    out = []
    groups = {}
    for r in records:
        groups.setdefault((r["workload"], r["batch_size"]), []).append(r)
    for (w, b), rs in groups.items():
        by = {r["strategy"]: r for r in rs if r["strategy"] != "convert_budget"}
        none = by.get("no_recompute")
        if none is None:
            continue
        for r in rs:
            ck = by.get(CHECKPOINT_OF.get(r["strategy"], ""))
            if ck is None:
                continue
            row = {"workload": w, "batch_size": b, "strategy": r["strategy"], "knob_name": r["knob_name"],
                   "knob": r["knob"], "checkpoint_strategy": ck["strategy"],
                   "time_over_no_recompute": r["median_s"] / none["median_s"],
                   "time_over_checkpoint": r["median_s"] / ck["median_s"],
                   "saved_over_no_recompute": r["saved_activation_bytes"] / max(none["saved_activation_bytes"], 1),
                   "saved_over_checkpoint": r["saved_activation_bytes"] / max(ck["saved_activation_bytes"], 1)}
            if step_peak(r) is not None and step_peak(none) and step_peak(ck):
                row["step_peak_over_no_recompute"] = step_peak(r) / step_peak(none)
                row["step_peak_over_checkpoint"] = step_peak(r) / step_peak(ck)
            out.append(row)
    return out


def backend_for(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "reference"

