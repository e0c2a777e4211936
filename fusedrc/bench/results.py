"""Result files: one JSON per run (schema in ``schema.py``) and a tidy CSV beside it."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from . import schema


def step_peak(r):
    """Peak bytes one step allocated above what was resident before it (CUDA), else None."""
    if r.get("peak_allocated_bytes") is None or r.get("allocated_before_step_bytes") is None:
        return None
    return r["peak_allocated_bytes"] - r["allocated_before_step_bytes"]


def own_peak(r):
    """The step's own peak: above what was resident where the file records that, else the plain
    peak (older files); None without a peak (CPU)."""
    p = step_peak(r)
    return p if p is not None else r.get("peak_allocated_bytes")

_CSV_SWEEP = ("workload", "strategy", "batch_size", "knob_name", "knob", "recomputed_blocks", "n_blocks",
              "median_s", "p20_s", "p80_s", "saved_activation_bytes", "peak_allocated_bytes",
              "allocated_before_step_bytes", "compile_s",
              "recomputed_units", "n_units", "convert_s")
_CSV_KERNELS = ("pattern", "strategy", "shape", "gemm_units", "flops", "median_s", "p20_s", "p80_s", "tflops",
                "fraction_of_gemm_rate", "saved_activation_bytes")


DEFAULT_WORKLOADS = ["ffn", "resnet"]


def stem(doc) -> str:
    """``bench_<kind>[_<workloads>][_quick]_<device>_<UTC time>``; the workloads are named (joined by ``-``)
    when a sweep ran other than the default set (e.g. ``bench_sweep_resnet50_cpu_...``)."""
    t = doc["timestamp"].replace("-", "").replace(":", "").replace("+0000", "").replace("T", "-")[:15]
    tag = ""
    if doc["kind"] == "sweep" and doc["settings"]["workloads"] != DEFAULT_WORKLOADS:
        tag = "_" + "-".join(doc["settings"]["workloads"])
    return f"bench_{doc['kind']}{tag}{'_quick' if doc['quick'] else ''}_{doc['device']['type']}_{t}"


def write(doc, results_dir) -> tuple[Path, Path]:
    schema.validate(doc)
    d = Path(results_dir)
    d.mkdir(parents=True, exist_ok=True)
    base = d / stem(doc)
    js, cs = base.with_suffix(".json"), base.with_suffix(".csv")
    js.write_text(json.dumps(doc, indent=1) + "\n")
    cols = _CSV_SWEEP if doc["kind"] == "sweep" else _CSV_KERNELS
    with cs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("device", "dtype") + cols)
        for c in doc["configs"]:
            row = []
            for k in cols:
                v = c.get(k)
                if isinstance(v, dict):
                    v = " ".join(f"{a}={b}" for a, b in v.items())
                row.append("" if v is None else v)
            w.writerow([doc["device"]["name"], doc["dtype"], *row])
    return js, cs


def load(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such result file: {p}")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON: {e}") from None
    schema.validate(doc)
    return doc
