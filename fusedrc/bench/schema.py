"""The result file's schema (``fusedrc-bench/1``) and a dependency-free validator.

A spec is a Python type (or tuple of types), ``None`` for JSON null, a list with
one spec (every element matches it), a dict (required keys and their specs;
keys ending in ``?`` are optional; other keys are allowed) or ``Enum(...)``.
``validate(doc)`` raises ``SchemaError`` naming the first offending path.

Sweep documents, real-model additions (``--workload resnet50/opt/models``; all
optional, so earlier files still validate and the id stays ``fusedrc-bench/1``):

* ``configs[].strategy`` may also be ``torch_checkpoint_blocks`` (``torch.utils.checkpoint``
  on each whole block), ``convert_all`` / ``convert_blocks`` (``fusedrc.convert(policy=...)``)
  or ``convert_budget`` (``fusedrc.convert(memory_budget=knob)``); on a real model
  ``torch_checkpoint`` is ``torch.utils.checkpoint`` on exactly the units convert fuses.
* ``configs[].knob_name`` may be ``memory_budget`` (convert's fraction of the original's
  activation bytes); the other real-model strategies have ``recompute_fraction`` 0
  (original) or 1 (every unit or block of the strategy).
* ``configs[]`` of a real model also carry ``recomputed_units`` (units fused or
  checkpointed), ``n_units`` (units convert found), ``convert_s`` (seconds
  ``fusedrc.convert`` took, budget planning included; null when not converted),
  ``plan_baseline_bytes`` / ``plan_final_bytes`` (convert's own count of the original's
  and the converted model's activation bytes; null when not measured).
* ``settings.budgets``: workload -> the memory_budget fractions asked for.
* ``settings.channels_last``: the image workloads ran in channels_last (``--channels-last``).
* ``model_ratios``: per real model, batch size and convert configuration, step time and
  saved bytes over the original's (``*_over_no_recompute``) and over
  ``checkpoint_strategy``'s (``*_over_checkpoint``: ``torch_checkpoint_blocks`` for
  ``convert_blocks``, else ``torch_checkpoint``); on CUDA also ``step_peak_over_*``
  (peak allocated during a step minus what was allocated before it).
"""
from __future__ import annotations

SCHEMA_ID = "fusedrc-bench/1"

NUM = (int, float)
OPT_NUM = (int, float, type(None))
OPT_STR = (str, type(None))
OPT_INT = (int, type(None))
SWEEP_STRATEGIES = ("no_recompute", "torch_checkpoint", "fusedrc", "torch_compile",  # synthetic workloads
                    "torch_checkpoint_blocks", "convert_all", "convert_blocks", "convert_budget")  # real models


class SchemaError(ValueError):
    pass


class Enum:
    def __init__(self, *values):
        self.values = values


COMMON = {
    "schema": Enum(SCHEMA_ID),
    "kind": Enum("sweep", "kernels"),
    "timestamp": str,
    "command": str,
    "elapsed_s": NUM,
    "quick": bool,
    "git_commit": OPT_STR,
    "git_dirty": (bool, type(None)),
    "device": {"type": Enum("cpu", "cuda"), "name": str, "cores": (int, type(None)), "torch_threads": int,
               "capability": OPT_STR},
    "versions": {"torch": str, "triton": OPT_STR, "fusedrc": str, "python": str},
    "loadavg": {"start": ([NUM], type(None)), "end": ([NUM], type(None))},
    "dtype": Enum("float32", "float16", "bfloat16"),
    "fusedrc_backend": Enum("reference", "triton"),
    "timer": str,
    "warmup": int,
    "repeats": int,
    "notes": [str],
    "skipped": [{"what": str, "reason": str}],
}

TIMING = {"times_s": [NUM], "median_s": NUM, "p20_s": NUM, "p80_s": NUM}

SWEEP = {
    **COMMON,
    "complete?": bool,  # false: interrupted (a timeout's SIGTERM), the configurations measured so far
    "settings": {"workloads": [str], "batch_sizes": dict, "fractions": [NUM], "compile_budgets": dict,
                 "compile_batch_sizes": dict, "budgets?": dict, "channels_last?": bool},
    "workloads": dict,
    "configs": [{
        "workload": str, "strategy": Enum(*SWEEP_STRATEGIES),
        "batch_size": int, "knob_name": Enum("recompute_fraction", "activation_memory_budget", "memory_budget"),
        "knob": NUM, "recomputed_blocks": (int, type(None)), "n_blocks": int, **TIMING,
        "saved_activation_bytes": int, "peak_allocated_bytes": (int, type(None)),
        "allocated_before_step_bytes": (int, type(None)), "compile_s": OPT_NUM,
        "recomputed_units?": int, "n_units?": int, "convert_s?": OPT_NUM,
        "plan_baseline_bytes?": OPT_INT, "plan_final_bytes?": OPT_INT,
    }],
    "ratios": [{"workload": str, "batch_size": int, "time_fusedrc_over_checkpoint": NUM,
                "time_fusedrc_over_no_recompute": NUM, "time_checkpoint_over_no_recompute": NUM,
                "saved_fusedrc_over_checkpoint": NUM, "saved_fusedrc_over_no_recompute": NUM,
                "saved_checkpoint_over_no_recompute": NUM}],
    "model_ratios?": [{"workload": str, "batch_size": int,
                       "strategy": Enum("convert_all", "convert_blocks", "convert_budget"),
                       "knob_name": str, "knob": NUM,
                       "checkpoint_strategy": Enum("torch_checkpoint", "torch_checkpoint_blocks"),
                       "time_over_no_recompute": NUM, "time_over_checkpoint": NUM,
                       "saved_over_no_recompute": NUM, "saved_over_checkpoint": NUM,
                       "step_peak_over_no_recompute?": NUM, "step_peak_over_checkpoint?": NUM}],
}

KERNELS = {
    **COMMON,
    "gemm_rate": {"shape": [int], "median_s": NUM, "tflops": NUM},
    "complete?": bool,
    "configs": [{
        "pattern": Enum("linear_act", "fused_mlp", "fused_mlp_dropout", "gated_mlp", "norm_gated_mlp", "moe_experts",
                        "mix_ffn", "xielu_mlp", "conv_bn_act", "bn_act_conv"),
        "strategy": Enum("eager", "torch_checkpoint", "fusedrc"), "shape": dict, "gemm_units": NUM,
        "flops": int, **TIMING, "tflops": NUM, "fraction_of_gemm_rate": NUM, "saved_activation_bytes": int,
    }],
}


def _check(value, spec, path):
    if isinstance(spec, Enum):
        if value not in spec.values:
            raise SchemaError(f"{path}: {value!r} is not one of {list(spec.values)}")
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected an object, got {type(value).__name__}")
        for key, sub in spec.items():
            optional = key.endswith("?")
            k = key.rstrip("?")
            if k not in value:
                if optional:
                    continue
                raise SchemaError(f"{path}: missing key {k!r}")
            _check(value[k], sub, f"{path}.{k}")
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise SchemaError(f"{path}: expected an array, got {type(value).__name__}")
        for i, v in enumerate(value):
            _check(v, spec[0], f"{path}[{i}]")
        return
    if isinstance(spec, tuple):
        errors = []
        for alt in spec:
            try:
                _check(value, alt, path)
                return
            except SchemaError as e:
                errors.append(str(e))
        raise SchemaError(f"{path}: {value!r} matches none of the allowed forms ({'; '.join(errors)})")
    if spec is None or spec is type(None):
        if value is not None:
            raise SchemaError(f"{path}: expected null, got {value!r}")
        return
    if spec in (int, float) and isinstance(value, bool):
        raise SchemaError(f"{path}: expected {spec.__name__}, got a boolean")
    if spec is float and isinstance(value, int):
        return
    if not isinstance(value, spec):
        raise SchemaError(f"{path}: expected {spec.__name__}, got {type(value).__name__} ({value!r:.60})")


def validate(doc) -> None:
    """Raise ``SchemaError`` unless ``doc`` is a valid ``fusedrc-bench/1`` result (sweep or kernels)."""
    if not isinstance(doc, dict):
        raise SchemaError("$: a result file holds a JSON object")
    kind = doc.get("kind")
    if kind not in ("sweep", "kernels"):
        raise SchemaError(f"$.kind: {kind!r} is not one of ['sweep', 'kernels']")
    _check(doc, SWEEP if kind == "sweep" else KERNELS, "$")
    if not doc["configs"]:
        raise SchemaError("$.configs: no configuration")
    from .measure import summarize

    for i, c in enumerate(doc["configs"]):
        if len(c["times_s"]) < 1:
            raise SchemaError(f"$.configs[{i}].times_s: no timing")
        if min(c["times_s"]) < 0:
            raise SchemaError(f"$.configs[{i}].times_s: negative timing {min(c['times_s'])}")
        if not c["p20_s"] <= c["median_s"] <= c["p80_s"]:
            raise SchemaError(f"$.configs[{i}]: expected p20_s <= median_s <= p80_s")
        # the summaries plots and tables read are the raw timings' quantiles
        for key, value in summarize(c["times_s"]).items():
            if abs(c[key] - value) > 1e-9 + 1e-6 * abs(value):
                raise SchemaError(f"$.configs[{i}].{key}: {c[key]} is not the quantile of times_s ({value})")
        for key in ("saved_activation_bytes", "peak_allocated_bytes", "allocated_before_step_bytes"):
            if isinstance(c.get(key), int) and c[key] < 0:
                raise SchemaError(f"$.configs[{i}].{key}: negative byte count {c[key]}")
