"""Real models: torchvision ResNet-50, EfficientNet-B0 and DenseNet-121 and small Hugging Face OPT, Mixtral
and BERT, built from code (no downloads).

Opt-in workloads (``--workload resnet50``, ``efficientnet_b0``, ``densenet121``, ``opt``, ``mixtral``, ``bert`` or
``models``:
ResNet-50 and OPT). Each is trained
for a step (``zero_grad`` + forward + loss + backward + ``SGD.step``) under these
strategies, each on its own copy of the same initial weights:

* ``no_recompute``             the original model;
* ``torch_checkpoint``         ``torch.utils.checkpoint(use_reentrant=False)`` on exactly the units
                               ``fusedrc.convert`` fuses (every Conv-BN-ReLU chain, residual tail and
                               the stem of the ResNet; EfficientNet's Conv-BN-SiLU chains, depthwise
                               ones included, and its projections' Conv-BN; every decoder layer's FFN
                               fc1 -> ReLU -> fc2 of OPT; every MoE layer's routed experts and Mixtral's):
                               the converted model with its units switched to checkpoint;
* ``torch_checkpoint_blocks``  ``torch.utils.checkpoint`` on each whole block (ResNet ``Bottleneck``,
                               EfficientNet ``MBConv``, ``OPTDecoderLayer``, ``MixtralDecoderLayer``: the blocks
                               ``convert(policy="blocks")`` recomputes);
* ``convert_all``              ``fusedrc.convert(model, policy="all")``: every unit fused;
* ``convert_blocks``           ``fusedrc.convert(model, policy="blocks")``: every unit fused and every
                               block recomputed whole (``fusedrc.mark``);
* ``convert_budget``           ``fusedrc.convert(model, memory_budget=b, example_inputs=(batch,))`` for a
                               few ``b``: a fraction of the original's activation bytes *as convert counts
                               them* (its count also takes in saved views of weights, e.g. a Linear's
                               ``weight.t()``, which the bench leaves out, so the bench's measured fraction
                               can differ from ``b``: both are in the result file); convert picks units,
                               and whole blocks where units are not enough.

Losses: cross-entropy against random labels (the image models, 1000 classes) and the
causal-LM loss of the token batch against itself shifted by one (OPT, Mixtral), computed
on the logits outside the counted forward (as ``convert`` measures ``model(x)``).
"""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusedrc
from fusedrc.convert import _set_impl, import_torchvision

MODEL_WORKLOADS = ("resnet50", "efficientnet_b0", "densenet121", "opt", "mixtral", "bert")
IMAGE_MODELS = ("resnet50", "efficientnet_b0", "densenet121")  # torchvision classifiers: images in, 1000 logits out
MODEL_STRATEGIES = ("no_recompute", "torch_checkpoint", "torch_checkpoint_blocks", "convert_all",
                    "convert_blocks", "convert_budget")
# EfficientNet-B0: units keep ~0.42 of the activations, whole blocks ~0.05 (README, CPU at 64 px)
# Mixtral: its fused experts keep ~0.35 of the activations (examples/train_opt.py --arch mixtral)
# DenseNet-121: pre-activation units keep ~0.52, whole layers ~0.15 (README, CPU at 64 px)
BUDGETS = {"resnet50": (0.8, 0.6, 0.45), "efficientnet_b0": (0.8, 0.5, 0.3), "densenet121": (0.7, 0.4, 0.25),
           "opt": (0.75, 0.5, 0.35),
           "mixtral": (0.6, 0.4, 0.25), "bert": (0.75, 0.5, 0.35)}
QUICK_BUDGETS = {"resnet50": (0.85,), "efficientnet_b0": (0.6,), "densenet121": (0.4,), "opt": (0.5,), "mixtral": (0.5,), "bert": (0.5,)}
_LR = 1e-4


def require(name: str):
    """``None`` when the packages workload ``name`` needs import here, else the reason."""
    try:
        if name in IMAGE_MODELS:
            import_torchvision()
        else:
            try:  # transformers imports torchvision when it is installed; the helper makes a CUDA wheel load
                import_torchvision()
            except ImportError:
                pass
            import transformers  # noqa: F401
    except ImportError as e:
        pkg = "torchvision" if name in IMAGE_MODELS else "transformers"
        return f"workload {name!r} needs {pkg} ({e}); install it (pip install -e '.[test]')"
    return None


# --------------------------------------------------------------------------- workloads
@dataclass
class ModelWorkload:
    name: str
    model: nn.Module
    shapes: dict
    description: str
    loss_desc: str
    n_blocks: int = 0
    n_units: int = 0
    plan_info: dict = field(default_factory=dict)

    def make_batch(self, batch, device, dtype, seed=1):
        """``(positional inputs of the model, target)`` on ``device``."""
        g = torch.Generator().manual_seed(seed)
        if self.name in IMAGE_MODELS:
            res = self.shapes["resolution"]
            x = torch.randn((batch, 3, res, res), generator=g).to(device=device, dtype=dtype)
            if self.shapes.get("channels_last"):
                x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, self.shapes["classes"], (batch,), generator=g).to(device)
            return (x,), y
        ids = torch.randint(0, self.shapes["vocab"], (batch, self.shapes["seq"]), generator=g).to(device)
        return (ids,), ids

    def output(self, out):
        return out if isinstance(out, torch.Tensor) else out.logits

    def loss(self, out, target):
        out = self.output(out).float()
        if self.name in IMAGE_MODELS:
            return F.cross_entropy(out, target)
        return F.cross_entropy(out[:, :-1].reshape(-1, out.size(-1)), target[:, 1:].reshape(-1))


def _lm_shape(quick: bool, cuda: bool, gpu: dict) -> dict:
    """A transformer workload's sizes: tiny (--quick), ``gpu`` on a GPU, a CPU-sized default; and
    transformers made importable (it imports torchvision when it is installed)."""
    try:
        import_torchvision()
    except ImportError:
        pass
    if quick:
        return dict(hidden=64, layers=2, ffn=256, heads=4, vocab=256, seq=32)
    return gpu if cuda else dict(hidden=256, layers=4, ffn=1024, heads=4, vocab=2048, seq=128)


def _lm_info(config, cfg: dict, model_cls: str, ffn_word: str, activation: str):
    """(shapes, description) of a transformer workload built from ``cfg`` (dropout 0.1)."""
    shapes = dict(cfg, activation=activation, dropout=0.1, attn_implementation=config._attn_implementation)
    desc = (f"transformers {model_cls}({type(config).__name__}(hidden {cfg['hidden']}, {cfg['layers']} layers, "
            f"{ffn_word} {cfg['ffn']}, {cfg['heads']} heads, vocab {cfg['vocab']}, {activation}, dropout 0.1)), "
            f"input batch x {cfg['seq']} random token ids")
    return shapes, desc


def build(name: str, device: torch.device, dtype: torch.dtype, quick: bool, seed: int = 0,
          channels_last: bool = False) -> ModelWorkload:
    """The real model ``name``; ``channels_last``: an image model's weights and input in that memory format."""
    torch.manual_seed(seed)
    cuda = device.type == "cuda"
    if name in IMAGE_MODELS:
        res = 32 if quick else (224 if cuda else 64)
        import torchvision.models

        # EfficientNet's dropout and stochastic depth stay on: the RNG outside the units is the
        # same in every strategy (the fused units draw none; checkpoint restores the RNG state)
        model = getattr(torchvision.models, name)(weights=None)
        shapes = dict(resolution=res, classes=1000)
        desc = f"torchvision {name}(weights=None), input batch x 3 x {res} x {res}"
        loss = "cross_entropy(logits, random labels)"
    elif name == "opt":  # on a GPU the shape of facebook/opt-125m
        cfg = _lm_shape(quick, cuda, dict(hidden=768, layers=12, ffn=3072, heads=12, vocab=50272, seq=512))
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], word_embed_proj_dim=cfg["hidden"],
                           num_hidden_layers=cfg["layers"], ffn_dim=cfg["ffn"], num_attention_heads=cfg["heads"],
                           max_position_embeddings=max(cfg["seq"], 64), activation_function="relu",
                           dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, use_cache=False)
        model = OPTForCausalLM(config)
        shapes, desc = _lm_info(config, cfg, "OPTForCausalLM", "ffn", "relu")
        loss = "causal-LM cross_entropy(logits[:, :-1], ids[:, 1:])"
    elif name == "mixtral":
        if quick:
            cfg = dict(hidden=64, layers=2, inter=128, experts=4, heads=4, kv_heads=2, vocab=256, seq=32)
        elif cuda:  # Mixtral 8x7B's proportions (8 experts, intermediate 3.5 x hidden, top-2), scaled down
            cfg = dict(hidden=1024, layers=8, inter=3584, experts=8, heads=16, kv_heads=8, vocab=32000, seq=512)
        else:
            cfg = dict(hidden=256, layers=4, inter=896, experts=8, heads=4, kv_heads=2, vocab=2048, seq=128)
        try:
            import_torchvision()
        except ImportError:
            pass
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["inter"],
                               num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                               num_key_value_heads=cfg["kv_heads"], num_local_experts=cfg["experts"],
                               num_experts_per_tok=2, max_position_embeddings=max(cfg["seq"], 64), use_cache=False)
        model = MixtralForCausalLM(config)
        shapes = dict(cfg, top_k=2, activation="silu", attn_implementation=config._attn_implementation,
                      experts_implementation=config._experts_implementation)
        desc = (f"transformers MixtralForCausalLM(MixtralConfig(hidden {cfg['hidden']}, {cfg['layers']} layers, "
                f"{cfg['experts']} experts of intermediate {cfg['inter']}, top-2, {cfg['heads']} heads, vocab "
                f"{cfg['vocab']})), input batch x {cfg['seq']} random token ids")
        loss = "causal-LM cross_entropy(logits[:, :-1], ids[:, 1:])"
    elif name == "bert":  # on a GPU the shape of bert-base-uncased
        cfg = _lm_shape(quick, cuda, dict(hidden=768, layers=12, ffn=3072, heads=12, vocab=30522, seq=512))
        from transformers import BertConfig, BertForMaskedLM

        # its FFN spans BertIntermediate and BertOutput: convert's rule for BERT-style layers
        config = BertConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                            intermediate_size=cfg["ffn"], num_attention_heads=cfg["heads"],
                            max_position_embeddings=max(cfg["seq"], 64), hidden_act="gelu",
                            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
        model = BertForMaskedLM(config)
        shapes, desc = _lm_info(config, cfg, "BertForMaskedLM", "intermediate", "gelu")
        loss = "cross_entropy(logits[:, :-1], ids[:, 1:]) (a synthetic target)"
    else:
        raise ValueError(f"unknown model workload {name!r}; choose from {', '.join(MODEL_WORKLOADS)}")
    model.to(device=device, dtype=dtype).train()
    if channels_last and name in IMAGE_MODELS:
        model.to(memory_format=torch.channels_last)
        shapes["channels_last"] = True
        desc += " (channels_last)"
    return ModelWorkload(name, model, shapes, desc, loss)


# --------------------------------------------------------------------------- strategies
def checkpoint_blocks(model: nn.Module, names) -> nn.Module:
    """Run each submodule named in ``names`` under ``torch.utils.checkpoint(use_reentrant=False)``."""
    for n in names:
        block = model.get_submodule(n)
        fwd = block.forward

        def forward(*args, _fwd=fwd, **kwargs):
            if not torch.is_grad_enabled():
                return _fwd(*args, **kwargs)
            # a list argument as it is now: the caller may append to it before backward reruns the block
            # (DenseNet's block hands each layer its growing list of features)
            args = tuple(list(a) if isinstance(a, list) else a for a in args)
            return checkpoint(_fwd, *args, use_reentrant=False, **kwargs)

        block.__dict__["forward"] = forward
    return model


@dataclass
class ModelConfig:
    workload: str
    strategy: str
    batch_size: int
    knob_name: str  # "recompute_fraction" (1: every unit/block of the strategy) or "memory_budget"
    knob: float
    recomputed_blocks: int
    recomputed_units: int
    convert_s: float | None = None
    plan_baseline_bytes: int | None = None
    plan_final_bytes: int | None = None


class ModelRunner:
    """One strategy's model (its own copy of the weights), its optimizer and the batch."""

    def __init__(self, wl: ModelWorkload, cfg: ModelConfig, model, inputs, target):
        self.wl, self.cfg, self.model, self.inputs, self.target = wl, cfg, model, inputs, target
        self.opt = torch.optim.SGD(model.parameters(), lr=_LR)

    def forward(self):
        return self.wl.output(self.model(*self.inputs))

    def loss(self, out):
        return self.wl.loss(out, self.target)

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.forward())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # the copies' gradients do not stay resident between steps
        return loss


def _convert(model, **kw):
    """``fusedrc.convert`` (a copy), seconds it took, and its warnings (patterns left as they are)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fusedrc.convert(model, **kw)
    return out, time.perf_counter() - t0, [str(w.message) for w in caught]


def runners_for(wl: ModelWorkload, batch: int, device, dtype, budgets, skipped: list):
    """The runners of one (model, batch size), in the order they are timed."""
    inputs, target = wl.make_batch(batch, device, dtype)
    base = wl.model
    out = []

    def add(strategy, model, knob_name, knob, plan=None, convert_s=None, blocks=0, units=0):
        cfg = ModelConfig(wl.name, strategy, batch, knob_name, knob, blocks, units, convert_s,
                          plan.baseline_bytes if plan is not None else None,
                          plan.final_bytes if plan is not None else None)
        out.append(ModelRunner(wl, cfg, model, inputs, target))

    conv_all, t_all, warns = _convert(base, policy="all", example_inputs=inputs)
    plan = conv_all.fusedrc_plan
    wl.n_units, wl.n_blocks = len(plan.units), len(plan.blocks)
    wl.plan_info = {"unit_names": [u.name for u in plan.units],
                    "unit_kinds": sorted({u.kind for u in plan.units}),
                    "block_names": [b.name for b in plan.blocks], "convert_warnings": warns,
                    "left_as_they_are": [f"{n or '<model>'}: {r}" for n, r in plan.skipped]}
    add("no_recompute", copy.deepcopy(base), "recompute_fraction", 0.0)
    ck_units, _, _ = _convert(base, policy="all")
    _set_impl(ck_units, "checkpoint")
    add("torch_checkpoint", ck_units, "recompute_fraction", 1.0, units=len(plan.fused))
    ck_blocks = checkpoint_blocks(copy.deepcopy(base), wl.plan_info["block_names"])
    add("torch_checkpoint_blocks", ck_blocks, "recompute_fraction", 1.0, blocks=wl.n_blocks)
    add("convert_all", conv_all, "recompute_fraction", 1.0, plan, t_all, units=len(plan.fused))
    conv_blocks, t_blocks, _ = _convert(base, policy="blocks", example_inputs=inputs)
    p = conv_blocks.fusedrc_plan
    add("convert_blocks", conv_blocks, "recompute_fraction", 1.0, p, t_blocks, len(p.recomputed_blocks), len(p.fused))
    for b in budgets:
        try:
            conv_b, t_b, _ = _convert(base, memory_budget=float(b), example_inputs=inputs)
        except ValueError as e:
            skipped.append({"what": f"{wl.name} batch {batch}: convert(memory_budget={b:g})", "reason": str(e)})
            continue
        p = conv_b.fusedrc_plan
        add("convert_budget", conv_b, "memory_budget", float(b), p, t_b, len(p.recomputed_blocks), len(p.fused))
    return out
