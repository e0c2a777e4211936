"""Activation bytes that ``fusedrc.convert`` keeps on models whose norms no earlier kind modelled.

For each model (small configs built from code, no downloads) and dtype it measures the bytes autograd
keeps for one training forward (``fusedrc.convert.saved_bytes``): the original; ``convert`` with every
unit; and ``convert`` with every unit but the norm units (kind ``norm``: norms recomputed on their own).
Gemma's RMSNorm (times ``1 + weight``) is kind ``"gemma_rms"``: it joins the FFN's op or is a norm unit;
Cohere's, OLMo's, DeBERTa's and the channels-first LayerNorms rerun their own forward.

    python benchmarks/norm_bytes.py [--out benchmarks/results]

Writes ``norm_bytes_cpu_<time>.json`` (bytes, unit counts, versions, commit). CPU only: bytes do not
depend on the device.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

import fusedrc
from fusedrc.bench import measure
from fusedrc.convert import saved_bytes


def _models():
    sys.modules["fusedrc.convert"].import_torchvision()
    import timm
    import torchvision
    import transformers as T

    def lm(config, model, attn="sdpa", **kw):
        base = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
        return lambda: model(config(**dict(base, **kw)))

    ids = lambda dtype: (torch.randint(0, 1000, (2, 64)),)  # noqa: E731
    image = lambda dtype: (torch.randn(2, 3, 64, 64, dtype=dtype),)  # noqa: E731
    return {
        "gemma": (lm(T.GemmaConfig, T.GemmaForCausalLM, head_dim=32), ids),
        # Gemma 2's logit soft-capping has no sdpa path in transformers
        "gemma2_eager_attention": (lm(T.Gemma2Config, T.Gemma2ForCausalLM, attn="eager", head_dim=32), ids),
        "gemma3": (lm(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=32), ids),
        "cohere": (lm(T.CohereConfig, T.CohereForCausalLM), ids),
        "olmo": (lm(T.OlmoConfig, T.OlmoForCausalLM), ids),
        "deberta": (lambda: T.DebertaModel(T.DebertaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                                          num_hidden_layers=2, num_attention_heads=4)), ids),
        "torchvision_convnext_tiny": (torchvision.models.convnext_tiny, image),
        "timm_convnext_atto": (lambda: timm.create_model("convnext_atto"), image),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    records = []
    for name, (build, inputs) in _models().items():
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = build().to(dtype).train()
            if "convnext" in name:
                model.eval()  # no stochastic-depth draws (ConvNeXt has no BatchNorm: eval changes nothing else)
            example = inputs(dtype)
            original = saved_bytes(model, example)
            conv = fusedrc.convert(model)
            units = conv.fusedrc_plan.units
            without = fusedrc.convert(model, policy=[u.name for u in units if u.kind != "norm"])
            kinds = {}
            for u in units:
                kinds[u.kind] = kinds.get(u.kind, 0) + 1
            rec = dict(model=name, dtype=str(dtype).replace("torch.", ""), original_bytes=original,
                       all_units_bytes=saved_bytes(conv, example),
                       without_norm_units_bytes=saved_bytes(without, example), units=kinds)
            records.append(rec)
            print(f"{name:28s} {rec['dtype']:9s} without norm units {rec['without_norm_units_bytes'] / original:.3f}"
                  f"  all units {rec['all_units_bytes'] / original:.3f}  {kinds}", flush=True)
    path = measure.write_results(args.out, "norm_bytes_cpu", "norm_bytes", torch.device("cpu"), records=records)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
