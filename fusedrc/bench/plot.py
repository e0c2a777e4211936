"""Plots drawn from a result document alone (matplotlib, Agg, PNG)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .results import own_peak, step_peak  # noqa: E402

STYLE = {  # strategy: (label, color, marker)
    "no_recompute": ("no recompute", "#444444", "s"),
    "torch_checkpoint": ("torch.utils.checkpoint", "#1f77b4", "o"),
    "fusedrc": ("fusedrc", "#d62728", "^"),
    "torch_compile": ("torch.compile (activation_memory_budget)", "#2ca02c", "D"),
    "eager": ("eager (unfused)", "#444444", None),
    # real models (models.py)
    "torch_checkpoint_blocks": ("torch.utils.checkpoint on blocks", "#1f77b4", "o"),
    "convert_all": ("fusedrc.convert(policy='all')", "#d62728", "^"),
    "convert_blocks": ("fusedrc.convert(policy='blocks')", "#d62728", "^"),
    "convert_budget": ("fusedrc.convert(memory_budget=b)", "#ff7f0e", "D"),
}
SHORT = {  # strategy: name in the printed tables
    "no_recompute": "no recompute", "torch_checkpoint": "torch.utils.checkpoint", "fusedrc": "fusedrc",
    "torch_compile": "torch.compile (budget)", "torch_checkpoint_blocks": "checkpoint (blocks)",
    "convert_all": "convert(all)", "convert_blocks": "convert(blocks)", "convert_budget": "convert(budget)",
}
MODEL_STRATEGIES = ("torch_checkpoint_blocks", "convert_all", "convert_blocks", "convert_budget")
_FRACTION_LABEL = {0.0: "0", 0.25: "¼", 0.5: "½", 0.75: "¾", 1.0: "1"}
# label offsets (points) per strategy, so labels of coinciding points go different ways
_OFFSET = {"no_recompute": (-8, 8), "torch_checkpoint": (-10, 7), "fusedrc": (7, -11), "torch_compile": (7, 6)}


def _title_device(doc):
    d = doc["device"]
    extra = f", {d['cores']} cores" if d["type"] == "cpu" and d.get("cores") else ""
    return f"{d['name']} ({d['type']}{extra}), {doc['dtype']}, torch {doc['versions']['torch']}"


def _knob_label(c):
    if c["knob_name"] == "recompute_fraction":
        return _FRACTION_LABEL.get(c["knob"], f"{c['knob']:g}")
    return f"b={c['knob']:g}"


def _declutter(fig, ax, texts, tries=14):
    """Nudge annotation labels up/down until their boxes stop overlapping the markers and earlier labels."""
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    placed = []
    for line in ax.get_lines():
        if line.get_marker() in (None, "None", "", " "):
            continue
        for px, py in ax.transData.transform(line.get_xydata()):
            placed.append(Bbox.from_extents(px - 4, py - 4, px + 4, py + 4))
    for t in texts:
        for i in range(tries):
            bb = t.get_window_extent(r).expanded(1.05, 1.1)
            if not any(bb.overlaps(p) for p in placed):
                break
            dx, dy = t.xyann
            step = 7 * (i // 2 + 1) * (1 if i % 2 == 0 else -1)
            t.xyann = (dx, dy + step)
        placed.append(t.get_window_extent(r))


def _memory(doc, c):
    """Saved activation bytes (CPU), or on CUDA the step's peak above what was resident before it
    (the sweep's other workloads, and the real models' strategy copies, stay resident), or the
    plain peak where a file has no resident figure."""
    if doc["device"]["type"] == "cuda" and c.get("peak_allocated_bytes"):
        label = ("peak memory of a step above what was resident (MiB)" if step_peak(c) is not None
                 else "peak allocated memory per step (MiB)")
        return own_peak(c) / 2**20, label
    return c["saved_activation_bytes"] / 2**20, "activation bytes kept by autograd (MiB)"


# real-model curves: (legend label, color, marker, [(strategy, point label)]), each starting at the original
_MODEL_LINES = (
    ("torch.utils.checkpoint (units convert fuses → whole blocks)", "#1f77b4", "o",
     [("torch_checkpoint", "units"), ("torch_checkpoint_blocks", "blocks")]),
    ("fusedrc.convert (policy 'all' → 'blocks')", "#d62728", "^",
     [("convert_all", "all"), ("convert_blocks", "blocks")]),
    ("fusedrc.convert(memory_budget=b)", "#ff7f0e", "D", [("convert_budget", None)]),
)
_MODEL_OFFSET = {"#1f77b4": (-14, 8), "#d62728": (12, -10), "#ff7f0e": (14, 7)}


def _yerr(cs):
    """The p20-p80 bars (ms) around the medians of ``cs``."""
    return [[(c["median_s"] - c["p20_s"]) * 1e3 for c in cs], [(c["p80_s"] - c["median_s"]) * 1e3 for c in cs]]


def _finish_axes(ax, xlabel, title, xmax, ymax):
    """Labels, grid and limits of one memory-vs-step-time panel (x from 0, y from 0)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("step time, median (ms), bars p20–p80")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0, right=1.12 * xmax)
    ax.set_ylim(0, ymax)


def _plot_model(doc, wl, cs, plots_dir):
    batches = sorted({c["batch_size"] for c in cs})
    fig, axes = plt.subplots(1, len(batches), figsize=(max(8.0, 6.6 * len(batches)), 5.8), squeeze=False)
    handles, all_texts = {}, []
    xlabel = None
    for ax, b in zip(axes[0], batches):
        rows = [c for c in cs if c["batch_size"] == b]
        base = next((c for c in rows if c["strategy"] == "no_recompute"), None)
        texts = []
        for label, color, marker, parts in _MODEL_LINES:
            pts = [(base, None)] if base is not None else []
            for strategy, plabel in parts:
                got = [c for c in rows if c["strategy"] == strategy]
                got.sort(key=lambda c: -c["knob"])  # budgets: loose to tight
                pts += [(c, plabel or f"b={c['knob']:g}") for c in got]
            if len(pts) < 2:
                continue
            xs = [_memory(doc, c)[0] for c, _ in pts]
            xlabel = _memory(doc, pts[-1][0])[1]
            ys = [c["median_s"] * 1e3 for c, _ in pts]
            handles[label] = ax.errorbar(xs, ys, yerr=_yerr([c for c, _ in pts]), color=color, marker=marker, ms=7, lw=1.6, capsize=3,
                                         label=label, zorder=3 if "fusedrc" in label else 2)
            for x, y, (c, plabel) in zip(xs, ys, pts):
                if plabel is None:
                    continue
                texts.append(ax.annotate(plabel, (x, y), xytext=_MODEL_OFFSET[color], textcoords="offset points",
                                         fontsize=8, color=color, ha="center", va="center"))
        if base is not None:
            m, xlabel = _memory(doc, base)
            handles["original (no recompute)"] = ax.errorbar(
                [m], [base["median_s"] * 1e3],
                yerr=_yerr([base]),
                color=STYLE["no_recompute"][1], marker="s", ms=9, ls="none", capsize=3, zorder=4,
                label="original (no recompute)")
        unit = "sequences" if wl in ("opt", "mixtral", "bert") else "images"
        _finish_axes(ax, xlabel, f"batch {b} {unit}", max(_memory(doc, c)[0] for c in rows),
                     1.35 * max(c["median_s"] for c in rows) * 1e3)
        all_texts.append(texts)
    info = doc["workloads"].get(wl, {})
    desc = "\n".join(textwrap.wrap(info.get("description", wl), 110))
    fig.suptitle(f"{wl}: memory vs training-step time (fusedrc backend: {doc['fusedrc_backend']})\n{desc}\n"
                 f"{_title_device(doc)}", fontsize=9.5)
    order = ["original (no recompute)"] + [lab for lab, *_ in _MODEL_LINES]
    labels = [lab for lab in order if lab in handles]
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=2, fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    kinds = {"resnet50": "Conv-BN-ReLU chains", "efficientnet_b0": "Conv-BN(-SiLU) chains",
             "densenet121": "BN-ReLU-Conv / Conv-BN-ReLU chains",
             "mixtral": "routed-experts modules"}.get(wl, "FFNs")
    fig.text(0.5, 0.105, f"units: the {info.get('units', '?')} {kinds} fusedrc.convert fuses; blocks: the "
             f"{info.get('blocks', '?')} blocks policy='blocks' recomputes whole;\nb: convert's memory_budget "
             "(a fraction of the original's activation bytes as convert counts them)",
             ha="center", va="center", fontsize=7.5, color="#555555")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    for ax, texts in zip(axes[0], all_texts):
        _declutter(fig, ax, texts)
    p = Path(plots_dir) / f"bench_{wl}{'_quick' if doc['quick'] else ''}_{doc['device']['type']}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_sweep(doc, plots_dir) -> list[Path]:
    out = []
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    by_wl = {}
    for c in doc["configs"]:
        by_wl.setdefault(c["workload"], []).append(c)
    for wl, cs in by_wl.items():
        if any(c["strategy"] in MODEL_STRATEGIES for c in cs):
            out.append(_plot_model(doc, wl, cs, plots_dir))
            continue
        batches = sorted({c["batch_size"] for c in cs})
        fig, axes = plt.subplots(1, len(batches), figsize=(max(8.0, 6.4 * len(batches)), 5.4), squeeze=False)
        handles = {}
        all_texts = []
        for ax, b in zip(axes[0], batches):
            rows = [c for c in cs if c["batch_size"] == b]
            base = [c for c in rows if c["strategy"] == "no_recompute"]
            texts = []
            xlabel = None
            for s in ("no_recompute", "torch_checkpoint", "fusedrc", "torch_compile"):
                pts = [c for c in rows if c["strategy"] == s]
                if not pts:
                    continue
                pts.sort(key=lambda c: c["knob"])
                if s in ("torch_checkpoint", "fusedrc"):
                    pts = base + pts  # fraction 0 is the no-recompute run
                label, color, marker = STYLE[s]
                xs = [_memory(doc, c)[0] for c in pts]
                xlabel = _memory(doc, pts[-1])[1]
                ys = [c["median_s"] * 1e3 for c in pts]
                handles[label] = ax.errorbar(xs, ys, yerr=_yerr(pts), color=color, marker=marker, ms=7 if s != "no_recompute" else 9,
                            lw=1.6, capsize=3, label=label, zorder=3 if s == "fusedrc" else 2,
                            ls="-" if s != "no_recompute" else "none")
                if s == "no_recompute":
                    continue
                for x, y, c in zip(xs, ys, pts):
                    if c["strategy"] == "no_recompute":
                        continue
                    texts.append(ax.annotate(_knob_label(c), (x, y), xytext=_OFFSET[s], textcoords="offset points",
                                             fontsize=8, color=color, ha="center", va="center"))
            unit = "tokens" if wl == "ffn" else "images"
            # the p20-p80 bars of a noisy step may run off the top: the medians set the scale
            _finish_axes(ax, xlabel, f"batch {b} {unit}", max(_memory(doc, c)[0] for c in rows),
                         1.45 * max(c["median_s"] for c in rows) * 1e3)
            all_texts.append(texts)
        info = doc["workloads"].get(wl, {})
        fig.suptitle(f"{wl} ({info.get('blocks', '?')} blocks): memory vs training-step time\n{_title_device(doc)}",
                     fontsize=11)
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)),
                   fontsize=8.5, frameon=False, bbox_to_anchor=(0.5, 0.0))
        fig.text(0.5, 0.065, "point labels: fraction of blocks recomputed (¼ … 1); b = torch.compile "
                 "activation_memory_budget", ha="center", fontsize=8, color="#555555")
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        for ax, texts in zip(axes[0], all_texts):
            _declutter(fig, ax, texts)
        p = plots_dir / f"bench_{wl}{'_quick' if doc['quick'] else ''}_{doc['device']['type']}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    return out


def plot_kernels(doc, plots_dir) -> list[Path]:
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    def case(c):  # one panel per (pattern, shape): a pattern may run at several shapes
        return c["pattern"], tuple(c["shape"].items())

    cases = []
    for c in doc["configs"]:
        if case(c) not in cases:
            cases.append(case(c))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.6 * len(cases), 4.6), squeeze=False)
    for ax, (p, _) in zip(axes[0], cases):
        rows = [c for c in doc["configs"] if case(c) == (p, _)]
        for i, c in enumerate(rows):
            label, color, _ = STYLE[c["strategy"]]
            y = c["median_s"] * 1e3
            err = [[(c["median_s"] - c["p20_s"]) * 1e3], [(c["p80_s"] - c["median_s"]) * 1e3]]
            ax.bar(i, y, color=color, yerr=err, capsize=4, label=label, width=0.7)
            ax.annotate(f"{c['tflops']:.0f} TFLOP/s" if c["tflops"] >= 10 else f"{c['tflops']:.2g} TFLOP/s", (i, c["p80_s"] * 1e3), xytext=(0, 4), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [STYLE[c["strategy"]][0].replace(" ", "\n", 1) for c in rows], fontsize=8)
        shape = " ".join(f"{k}={v}" for k, v in rows[0]["shape"].items())
        ax.set_title(f"{p}\n{shape}", fontsize=9)
        ax.set_ylabel("forward + backward, median (ms)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.18)
    backend = doc["fusedrc_backend"]
    fig.suptitle(f"per-kernel time (fusedrc backend: {backend}; TFLOP/s counts recompute)\n{_title_device(doc)}",
                 fontsize=10)
    if doc["device"]["type"] == "cpu":
        fig.text(0.5, 0.01, "CPU: fusedrc runs its pure-PyTorch reference backend; the Triton kernels are timed "
                 "only on a GPU", ha="center", fontsize=8, color="#555555")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
    else:
        fig.tight_layout()
    path = plots_dir / f"bench_kernels{'_quick' if doc['quick'] else ''}_{doc['device']['type']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot(doc, plots_dir) -> list[Path]:
    return plot_sweep(doc, plots_dir) if doc["kind"] == "sweep" else plot_kernels(doc, plots_dir)
