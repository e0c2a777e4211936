"""Which Hugging Face architectures ``fusedrc.convert`` fuses, and which MLP-like modules it leaves.

For every model type of the installed transformers (``MODEL_MAPPING_NAMES``: the bare models) the model is
built from its default config on the meta device (no memory, no weights; one or two layers where the config
says how many), converted (``inplace=True``), and reported: the fused units by kind, the patterns convert left
as they are (with its reason), and the modules whose class name says MLP / FFN / FeedForward / Experts /
Intermediate that no fused unit covers. A development tool, to find the rules worth writing next; nothing
runs a forward, so a unit found here is a structural match (the tests check the numbers of the families they
cover).

    python benchmarks/convert_survey.py [--only llama,qwen3_moe] [--out benchmarks/results]
    python benchmarks/convert_survey.py --library timm [--only resnet50,vit_base_patch16_224]

``--library timm``: every ``timm.list_models()`` architecture, built the same way (``timm.create_model``).

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


def survey_one(model_type, class_name, build=None):
    """One row: ``build()`` (default: the transformers model type's bare model on meta) converted."""
    import fusedrc

    rec = {"model_type": model_type, "class": class_name}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            model = build() if build is not None else _build(model_type, class_name)
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
    covered = lambda n: any(u == n or u.startswith(n + ".") or n.startswith(u + ".") for u in names)  # noqa: E731
    rec.update(units=kinds, skipped=[[n, r[:200]] for n, r in plan.skipped],
               uncovered=sorted({c for n, c in mlps.items() if not covered(n)}),
               warnings=sorted({str(w.message)[:200] for w in caught if "fusedrc" in str(w.message)})[:3],
               seconds=round(time.perf_counter() - t0, 2))
    return rec


def _timm_models(only):
    import timm

    def build(name):
        with torch.device("meta"):
            return timm.create_model(name, pretrained=False)

    for name in timm.list_models():
        if not only or name in only:
            yield name, name, lambda name=name: build(name)


def _transformers_models(only):
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    for model_type, class_name in MODEL_MAPPING_NAMES.items():
        if not only or model_type in only:
            yield model_type, class_name[0] if isinstance(class_name, (list, tuple)) else class_name, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", default="transformers", choices=("transformers", "timm"))
    ap.add_argument("--only", default="", help="comma-separated model types (timm: model names)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from fusedrc.convert import _import_torchvision

    with contextlib.suppress(ModuleNotFoundError):  # PyPI's torchvision on CPU torch: transformers imports it
        _import_torchvision()
    library = importlib.import_module(args.library)
    from fusedrc.bench import measure

    only = {s for s in args.only.split(",") if s}
    rows, complete = [], False
    models = _timm_models(only) if args.library == "timm" else _transformers_models(only)
    measure.interrupt_on_sigterm()  # cut by a timeout: the rows so far are written, complete False
    try:
        for model_type, class_name, build in models:
            rec = survey_one(model_type, class_name, build)
            rows.append(rec)
            if rec.get("uncovered") or "convert_error" in rec:
                print(f"{model_type:28s} units={rec.get('units')} uncovered={rec.get('uncovered')} "
                      f"{rec.get('convert_error', '')}", flush=True)
        complete = True
    except KeyboardInterrupt:
        print(f"interrupted after {len(rows)} model types", flush=True)
    stem = "convert_survey" if args.library == "transformers" else f"convert_survey_{args.library}"
    path = measure.write_results(args.out, stem, "convert_survey", torch.device("cpu"), library=args.library,
                                 complete=complete, **{args.library: library.__version__}, rows=rows)
    built = [r for r in rows if "build_error" not in r]
    fused = [r for r in built if r.get("units")]
    print(f"{len(rows)} model types, {len(built)} built on meta, {len(fused)} with fused units, "
          f"{sum(1 for r in built if r.get('uncovered'))} with uncovered MLP-like modules, "
          f"{sum(1 for r in built if 'convert_error' in r)} convert errors -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
