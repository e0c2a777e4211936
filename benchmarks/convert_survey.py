"""Which Hugging Face architectures ``fusedrc.convert`` fuses, and which MLP-like modules it leaves.

For every model type of the installed transformers (``MODEL_MAPPING_NAMES``: the bare models) the model is
built from its default config on the meta device (no memory, no weights; one or two layers where the config
says how many), converted (``inplace=True``), and reported: the fused units by kind, the patterns convert left
as they are (with its reason), and the modules whose class name says MLP / FFN / FeedForward / Experts /
Intermediate that no fused unit covers. A development tool, to find the rules worth writing next; nothing
runs a forward, so a unit found here is a structural match (the tests check the numbers of the families they
cover).

    python benchmarks/convert_survey.py [--only llama,qwen3_moe] [--out benchmarks/results]

Writes ``convert_survey_<UTC time>.json`` (versions, commit, one row per model type); prints the uncovered ones.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import sys
import time
import warnings

import torch

_MLP_NAME = re.compile(r"(MLP|Mlp|FFN|Ffn|FeedForward|Experts|Intermediate|DenseActDense|DenseGatedActDense)")
# config attributes that count layers (a model is built with one or two of each)
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_encoder_layers", "num_decoder_layers", "depth", "num_decoder_layers")


def _shrink(config):
    """One or two layers (two where a model alternates layer kinds) in the config and its sub-configs."""
    for key in _LAYER_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 2:
            setattr(config, key, 2)
    for name in ("text_config", "vision_config", "audio_config", "encoder_config", "decoder_config"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)
    return config


def _build(model_type, class_name):
    """The bare model on the meta device: from its default config with one or two layers, or where that
    config does not build (per-layer lists of its own length), with all of them."""
    import transformers
    from transformers import AutoConfig

    cls = getattr(transformers, class_name)
    try:
        with torch.device("meta"):
            return cls(_shrink(AutoConfig.for_model(model_type)))
    except Exception:  # noqa: BLE001
        with torch.device("meta"):
            return cls(AutoConfig.for_model(model_type))


def survey_one(model_type, class_name):
    import fusedrc

    rec = {"model_type": model_type, "class": class_name}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            model = _build(model_type, class_name)
    except Exception as e:  # noqa: BLE001 (a survey: every failure is a row)
        rec["build_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return rec
    mlps = {n: type(m).__name__ for n, m in model.named_modules() if _MLP_NAME.search(type(m).__name__)}
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("always")
            fusedrc.convert(model, inplace=True)
        plan = model.fusedrc_plan
    except Exception as e:  # noqa: BLE001
        rec["convert_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rec["mlp_modules"] = sorted(set(mlps.values()))
        return rec
    kinds = {}
    for u in plan.units:
        kinds[u.kind] = kinds.get(u.kind, 0) + 1
    names = [u.name for u in plan.units]
    covered = lambda n: any(u == n or u.startswith(n + ".") or n.startswith(u + ".") or n.startswith(u)  # noqa: E731
                            for u in names)
    rec.update(units=kinds, skipped=[[n, r[:200]] for n, r in plan.skipped],
               uncovered=sorted({c for n, c in mlps.items() if not covered(n)}),
               warnings=sorted({str(w.message)[:200] for w in caught if "fusedrc" in str(w.message)})[:3],
               seconds=round(time.perf_counter() - t0, 2))
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from fusedrc.convert import _import_torchvision

    with contextlib.suppress(ModuleNotFoundError):  # PyPI's torchvision on CPU torch: transformers imports it
        _import_torchvision()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    only = {s for s in args.only.split(",") if s}
    rows = []
    for model_type, class_name in MODEL_MAPPING_NAMES.items():
        if only and model_type not in only:
            continue
        if isinstance(class_name, (list, tuple)):
            class_name = class_name[0]
        rec = survey_one(model_type, class_name)
        rows.append(rec)
        if rec.get("uncovered") or "convert_error" in rec:
            print(f"{model_type:28s} units={rec.get('units')} uncovered={rec.get('uncovered')} "
                  f"{rec.get('convert_error', '')}", flush=True)
    from fusedrc.bench import measure

    path = measure.write_results(args.out, "convert_survey", "convert_survey", torch.device("cpu"),
                                 transformers=transformers.__version__, rows=rows)
    built = [r for r in rows if "build_error" not in r]
    fused = [r for r in built if r.get("units")]
    print(f"{len(rows)} model types, {len(built)} built on meta, {len(fused)} with fused units, "
          f"{sum(1 for r in built if r.get('uncovered'))} with uncovered MLP-like modules, "
          f"{sum(1 for r in built if 'convert_error' in r)} convert errors -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
