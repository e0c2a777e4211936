"""fusedrc-bench: the --quick sweep runs, its JSON validates, its plots are drawn and redrawn; bad options fail clearly.

The real models (--workload models: torchvision ResNet-50, Hugging Face OPT) run once, tiny, with one timed
step per configuration."""
from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import fusedrc  # noqa: E402
from fusedrc.bench import cli, kernels, measure, schema  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _assert_png_not_blank(path):
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
    assert float(img[..., :3].var()) > 1e-4, f"{path} looks blank"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One --quick sweep (both workloads) and one --quick kernels run, shared by the tests below."""
    d = tmp_path_factory.mktemp("bench")
    res, plots = d / "results", d / "plots"
    cli.main(["--quick", "--no-progress", "--results-dir", str(res), "--plots-dir", str(plots)])
    cli.main(["kernels", "--quick", "--no-progress", "--results-dir", str(res), "--plots-dir", str(plots)])
    return res, plots


def _one(res, kind):
    files = sorted(res.glob(f"bench_{kind}_quick_*.json"))
    assert len(files) == 1, files
    return files[0]


def test_quick_sweep_writes_valid_json_csv_and_plots(quick_run):
    res, plots = quick_run
    path = _one(res, "sweep")
    doc = json.loads(path.read_text())
    schema.validate(doc)
    assert doc["kind"] == "sweep" and doc["quick"] is True
    assert doc["device"]["type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert doc["fusedrc_backend"] == ("triton" if torch.cuda.is_available() else "reference")
    assert doc["loadavg"]["end"] is None or len(doc["loadavg"]["end"]) == 3
    # --quick leaves torch.compile out and says so
    assert any(s["what"] == "torch_compile" and "--quick" in s["reason"] for s in doc["skipped"])
    strategies = {(c["workload"], c["strategy"]) for c in doc["configs"]}
    for w in ("ffn", "resnet"):
        assert {(w, "no_recompute"), (w, "torch_checkpoint"), (w, "fusedrc")} <= strategies
        knobs = sorted(c["knob"] for c in doc["configs"] if c["workload"] == w and c["strategy"] == "fusedrc")
        assert knobs == [0.25, 0.5, 0.75, 1.0]
    for c in doc["configs"]:
        assert len(c["times_s"]) == doc["repeats"] and all(t > 0 for t in c["times_s"])
    # recomputing every block keeps less than no recompute; fusedrc keeps what checkpoint keeps (same regions;
    # its conv+bn op also keeps the per-channel mean and rstd, a fraction of a percent)
    for r in doc["ratios"]:
        assert r["saved_checkpoint_over_no_recompute"] < 1
        assert r["saved_fusedrc_over_checkpoint"] <= 1.01
    csv = path.with_suffix(".csv").read_text().splitlines()
    assert csv[0].startswith("device,dtype,workload,strategy") and len(csv) == 1 + len(doc["configs"])
    for w in ("ffn", "resnet"):
        _assert_png_not_blank(plots / f"bench_{w}_quick_{doc['device']['type']}.png")


def test_quick_kernels(quick_run):
    res, plots = quick_run
    doc = json.loads(_one(res, "kernels").read_text())
    schema.validate(doc)
    assert {c["pattern"] for c in doc["configs"]} == set(kernels.PATTERNS)
    assert {c["strategy"] for c in doc["configs"]} == {"eager", "torch_checkpoint", "fusedrc"}
    for c in doc["configs"]:
        assert c["tflops"] > 0 and c["flops"] > 0
        eager = next(e for e in doc["configs"] if e["pattern"] == c["pattern"] and e["strategy"] == "eager")
        if c["pattern"] == "bn_act_conv":  # no conv reruns (checkpoint's early stop ends before it)
            assert c["flops"] == eager["flops"]
        elif c["strategy"] != "eager":  # the recompute is counted
            assert c["flops"] > eager["flops"]
    saved = {(c["pattern"], c["strategy"]): c["saved_activation_bytes"] for c in doc["configs"]}
    # the fused FFN with dropout keeps x and its 8-byte Philox seed, never a mask
    assert saved["fused_mlp_dropout", "fusedrc"] == saved["fused_mlp", "fusedrc"] + 8
    assert saved["fused_mlp_dropout", "eager"] > saved["fused_mlp", "eager"]
    # the gated FFN keeps x alone, as checkpoint does; eager keeps its hidden-sized intermediates
    assert saved["gated_mlp", "fusedrc"] == saved["gated_mlp", "torch_checkpoint"] < saved["gated_mlp", "eager"]
    # with the RMSNorm before it: x alone again (the norm's input), the norm's output and stats not kept
    assert saved["norm_gated_mlp", "fusedrc"] == saved["norm_gated_mlp", "torch_checkpoint"] \
        == saved["gated_mlp", "fusedrc"] < saved["norm_gated_mlp", "eager"] - saved["gated_mlp", "fusedrc"]
    # the pre-activation op keeps x (and 2 floats a channel), as checkpoint does; eager keeps the activation too
    assert saved["bn_act_conv", "fusedrc"] <= saved["bn_act_conv", "torch_checkpoint"] + 8 * 32
    assert saved["bn_act_conv", "torch_checkpoint"] < saved["bn_act_conv", "eager"]
    # the Mix-FFN keeps x alone, as checkpoint does; eager keeps fc1's, the conv's and the activation's outputs
    assert saved["mix_ffn", "fusedrc"] == saved["mix_ffn", "torch_checkpoint"] < saved["mix_ffn", "eager"] / 8
    # the xIELU FFN keeps x (and the alphas' 1-element softplus inputs); eager about seven hidden-sized tensors
    assert saved["xielu_mlp", "fusedrc"] <= saved["xielu_mlp", "torch_checkpoint"] + 16
    assert saved["xielu_mlp", "torch_checkpoint"] < saved["xielu_mlp", "eager"] / 8
    # the routed experts keep the call's inputs (x, the routing index and weights), as checkpoint does
    assert saved["moe_experts", "fusedrc"] <= saved["moe_experts", "torch_checkpoint"] < saved["moe_experts", "eager"]
    if doc["device"]["type"] == "cpu":
        assert any("interpreter" in n for n in doc["notes"])
    _assert_png_not_blank(plots / f"bench_kernels_quick_{doc['device']['type']}.png")


def test_plot_redraws_from_saved_file(quick_run, tmp_path, capsys):
    res, _ = quick_run
    for kind in ("sweep", "kernels"):
        cli.main(["plot", str(_one(res, kind)), "--plots-dir", str(tmp_path)])
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 3, pngs
    for p in pngs:
        _assert_png_not_blank(p)
    assert "wrote" in capsys.readouterr().out


def test_schema_rejects_broken_documents(quick_run):
    res, _ = quick_run
    doc = json.loads(_one(res, "sweep").read_text())
    bad = json.loads(json.dumps(doc))
    del bad["device"]["name"]
    with pytest.raises(schema.SchemaError, match=r"\$\.device: missing key 'name'"):
        schema.validate(bad)
    bad = json.loads(json.dumps(doc))
    bad["configs"][0]["strategy"] = "magic"
    with pytest.raises(schema.SchemaError, match=r"configs\[0\]\.strategy"):
        schema.validate(bad)
    bad = json.loads(json.dumps(doc))
    bad["configs"][1]["times_s"] = ["fast"]
    with pytest.raises(schema.SchemaError, match=r"times_s\[0\]"):
        schema.validate(bad)
    # summaries that are not the raw timings' quantiles, negative timings or bytes
    bad = json.loads(json.dumps(doc))
    bad["configs"][0]["times_s"] = [t + 100.0 for t in bad["configs"][0]["times_s"]]
    with pytest.raises(schema.SchemaError, match=r"configs\[0\]\.median_s: .* is not the quantile of times_s"):
        schema.validate(bad)
    bad = json.loads(json.dumps(doc))
    bad["configs"][0]["saved_activation_bytes"] = -1
    with pytest.raises(schema.SchemaError, match=r"saved_activation_bytes: negative byte count"):
        schema.validate(bad)


# --------------------------------------------------------------------------- real models (resnet50, opt)
@pytest.fixture(scope="module")
def models_run(tmp_path_factory):
    """One tiny run of both real models (--quick: ResNet-50 at 32 px, a 2-layer OPT; batch 2, one budget each),
    no warm-up, one timed step per configuration: schema, bytes and plots are checked, not timings."""
    from fusedrc.bench import models

    for name in models.MODEL_WORKLOADS:
        why = models.require(name)
        if why:
            pytest.skip(why)
    d = tmp_path_factory.mktemp("bench_models")
    res, plots = d / "results", d / "plots"
    cli.main(["--workload", "models", "--quick", "--warmup", "0", "--repeats", "1", "--no-progress",
              "--results-dir", str(res), "--plots-dir", str(plots)])
    return res, plots


def test_models_quick_run_valid_json_and_plots(models_run):
    res, plots = models_run
    files = sorted(res.glob("bench_sweep_resnet50-opt_quick_*.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    schema.validate(doc)
    assert doc["settings"]["workloads"] == ["resnet50", "opt"] and doc["quick"] is True
    dev = doc["device"]["type"]
    for w in ("resnet50", "opt"):
        cs = {c["strategy"]: c for c in doc["configs"] if c["workload"] == w}
        assert set(cs) == {"no_recompute", "torch_checkpoint", "torch_checkpoint_blocks", "convert_all",
                           "convert_blocks", "convert_budget"}, (w, set(cs))
        info = doc["workloads"][w]
        assert info["model"] is True and info["units"] == len(info["unit_names"]) > 0
        assert info["blocks"] == len(info["block_names"]) > 0 and not info["left_as_they_are"]
        none, saved = cs["no_recompute"], {k: c["saved_activation_bytes"] for k, c in cs.items()}
        # checkpoint on the units convert fuses keeps what the fused units keep (conv+BN fused ops also keep
        # a per-channel mean and rstd: a few percent at this tiny size); whole blocks keep less than units
        assert saved["torch_checkpoint"] < saved["no_recompute"]
        # fp32 per-channel mean/rstd weigh more next to 16-bit activations (bf16 on CUDA), and the quick
        # ResNet-50's last stages are 1x1 pixels: there they are as large as the activation itself (its
        # downsample Conv-BN units, 2048 channels, add to them: 1.11x checkpoint's bytes in fp32 here;
        # 1.007x at 64 px, batch 8)
        slack = 1.15 if doc["dtype"] == "float32" else 1.25
        assert saved["convert_all"] <= slack * saved["torch_checkpoint"]
        assert saved["convert_blocks"] <= 1.05 * saved["torch_checkpoint_blocks"]
        assert saved["convert_blocks"] < saved["convert_all"] < saved["no_recompute"]
        assert cs["convert_all"]["recomputed_units"] == cs["torch_checkpoint"]["recomputed_units"] == info["units"]
        assert cs["convert_blocks"]["recomputed_blocks"] == cs["torch_checkpoint_blocks"]["recomputed_blocks"] \
            == info["blocks"]
        b = cs["convert_budget"]
        assert b["knob_name"] == "memory_budget" and b["knob"] == doc["settings"]["budgets"][w][0]
        assert b["plan_final_bytes"] <= b["knob"] * b["plan_baseline_bytes"]
        assert b["convert_s"] > 0 and none["convert_s"] is None
        for c in cs.values():
            assert len(c["times_s"]) == 1 and c["times_s"][0] > 0
        _assert_png_not_blank(plots / f"bench_{w}_quick_{dev}.png")
    rows = {(r["workload"], r["strategy"]): r for r in doc["model_ratios"]}
    assert rows["opt", "convert_blocks"]["checkpoint_strategy"] == "torch_checkpoint_blocks"
    assert rows["resnet50", "convert_all"]["checkpoint_strategy"] == "torch_checkpoint"
    assert all(r["saved_over_no_recompute"] < 1 for r in rows.values())
    csv = files[0].with_suffix(".csv").read_text().splitlines()
    assert csv[0].endswith("recomputed_units,n_units,convert_s") and len(csv) == 1 + len(doc["configs"])


def test_models_plot_redraws_from_saved_file(models_run, tmp_path):
    res, _ = models_run
    cli.main(["plot", str(next(res.glob("bench_sweep_resnet50-opt_quick_*.json"))), "--plots-dir", str(tmp_path)])
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(f"bench_{w}_quick_{'cuda' if torch.cuda.is_available() else 'cpu'}.png"
                          for w in ("resnet50", "opt"))


def _quick_model_run(tmp_path, name):
    """``fusedrc-bench --workload name --quick``, one repeat: (its validated result document, plots dir)."""
    from fusedrc.bench import models

    if why := models.require(name):
        pytest.skip(why)
    res, plots = tmp_path / "results", tmp_path / "plots"
    cli.main(["--workload", name, "--quick", "--warmup", "0", "--repeats", "1", "--no-progress",
              "--results-dir", str(res), "--plots-dir", str(plots)])
    (f,) = res.glob(f"bench_sweep_{name}_quick_*.json")
    doc = json.loads(f.read_text())
    schema.validate(doc)
    return doc, plots


def _quick_image_run(tmp_path, name, *, units, blocks, kind):
    """A quick run of an image workload: its units, blocks and a unit kind as expected, every strategy ran;
    (doc, plots dir, configs by strategy, saved activation bytes by strategy)."""
    from fusedrc.bench import models

    doc, plots = _quick_model_run(tmp_path, name)
    info = doc["workloads"][name]
    assert info["units"] == units and info["blocks"] == blocks and kind in info["unit_kinds"]
    cs = {c["strategy"]: c for c in doc["configs"]}
    assert set(cs) == set(models.MODEL_STRATEGIES)
    return doc, plots, cs, {k: c["saved_activation_bytes"] for k, c in cs.items()}


def test_efficientnet_quick_run(tmp_path):
    """The opt-in EfficientNet-B0 workload (depthwise Conv-BN-SiLU units, MBConv blocks): every strategy
    ran; the fused units keep what checkpoint on them keeps, whole blocks far less; the budget is met."""
    from fusedrc.bench import models

    doc, plots, cs, saved = _quick_image_run(tmp_path, "efficientnet_b0", units=49, blocks=16, kind="conv_bn_act")
    assert saved["convert_all"] <= 1.05 * saved["torch_checkpoint"] < saved["no_recompute"]
    assert saved["convert_blocks"] <= 1.05 * saved["torch_checkpoint_blocks"] < saved["torch_checkpoint"]
    b = cs["convert_budget"]
    assert b["knob"] == models.QUICK_BUDGETS["efficientnet_b0"][0]
    assert b["plan_final_bytes"] <= b["knob"] * b["plan_baseline_bytes"]
    _assert_png_not_blank(plots / f"bench_efficientnet_b0_quick_{doc['device']['type']}.png")


def test_densenet_quick_run(tmp_path):
    """The opt-in DenseNet-121 workload: its pre-activation units (bn_relu_conv) and dense layers as blocks;
    torch.utils.checkpoint on whole layers runs (each layer gets its list of features as it was at the
    call); the fused units keep what checkpoint on them keeps plus 2 floats a BatchNorm channel; the budget
    is met with blocks."""
    from fusedrc.bench import models

    doc, plots, cs, saved = _quick_image_run(tmp_path, "densenet121", units=120, blocks=58, kind="bn_relu_conv")
    stats = 8 * sum(m.num_features for m in _densenet121_bns())
    assert saved["convert_all"] <= saved["torch_checkpoint"] + stats < saved["no_recompute"]
    assert saved["convert_blocks"] < saved["torch_checkpoint"]
    b = cs["convert_budget"]
    assert b["knob"] == models.QUICK_BUDGETS["densenet121"][0]
    assert b["plan_final_bytes"] <= b["knob"] * b["plan_baseline_bytes"]
    _assert_png_not_blank(plots / f"bench_densenet121_quick_{doc['device']['type']}.png")


def _densenet121_bns():
    import torch.nn as nn
    from fusedrc.convert import import_torchvision

    import_torchvision()
    import torchvision

    return [m for m in torchvision.models.densenet121().modules() if isinstance(m, nn.BatchNorm2d)]


def test_mixtral_quick_run(tmp_path):
    """The opt-in Mixtral workload: its routed-experts units keep what checkpoint on them keeps and take
    the place of the experts inside whole blocks (the original implementation runs in a region)."""
    from fusedrc.bench import models

    doc, plots = _quick_model_run(tmp_path, "mixtral")
    info = doc["workloads"]["mixtral"]
    # 2 experts units; 5 norms (2 a layer, the final one) whose outputs are not kept
    assert info["units"] == 7 and info["blocks"] == 2 and info["unit_kinds"] == ["moe_experts", "norm"]
    cs = {c["strategy"]: c for c in doc["configs"]}
    assert set(cs) == set(models.MODEL_STRATEGIES)
    saved = {k: c["saved_activation_bytes"] for k, c in cs.items()}
    assert saved["convert_all"] <= saved["torch_checkpoint"] < 0.5 * saved["no_recompute"]
    assert saved["convert_blocks"] <= 1.1 * saved["torch_checkpoint_blocks"] < saved["torch_checkpoint"]
    _assert_png_not_blank(plots / f"bench_mixtral_quick_{doc['device']['type']}.png")


def test_bert_quick_run(tmp_path):
    """The opt-in BERT workload: convert's BERT-style layer rule fuses each layer's FFN (over BertIntermediate and
    BertOutput) and the MLM head's dense + GELU; the units keep what checkpoint on them keeps."""
    from fusedrc.bench import models

    doc, plots = _quick_model_run(tmp_path, "bert")
    info = doc["workloads"]["bert"]
    # and 6 LayerNorms (embeddings', 2 a layer, the MLM head's) whose outputs are not kept
    assert info["units"] == 9 and info["blocks"] == 2 and info["unit_kinds"] == ["ffn", "linear_act", "norm"]
    cs = {c["strategy"]: c for c in doc["configs"]}
    assert set(cs) == set(models.MODEL_STRATEGIES)
    saved = {k: c["saved_activation_bytes"] for k, c in cs.items()}
    assert saved["convert_all"] <= saved["torch_checkpoint"] < saved["no_recompute"]
    assert saved["convert_blocks"] <= 1.1 * saved["torch_checkpoint_blocks"] < saved["torch_checkpoint"]
    _assert_png_not_blank(plots / f"bench_bert_quick_{doc['device']['type']}.png")


def test_checkpoint_blocks_matches_original():
    """torch_checkpoint_blocks runs each block under torch.utils.checkpoint with the block's kwargs."""
    from torch import nn

    from fusedrc.bench.models import checkpoint_blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=1.0):
            return self.lin(x).relu() * scale

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(model)
    checkpoint_blocks(model, ["0", "1"])
    x = torch.randn(4, 8)
    ya, yb = ref(x), model(x)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    y = model[0](x, scale=2.0)  # kwargs pass through the checkpoint
    assert torch.equal(y, ref[0](x, scale=2.0))


@pytest.mark.parametrize("argv, needle", [
    (["--workload", "nope"], "--workload"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--batch-sizes", "8,x"], "--batch-sizes"),
    (["--dtype", "int8"], "--dtype"),
    (["--repeats", "0"], "--repeats"),
    (["--workload", "models", "--budgets", "0"], "--budgets"),
    (["--workload", "opt", "--budgets", "0.5,1.5"], "--budgets"),
    (["--workload", "ffn", "--budgets", "0.5"], "--budgets"),  # no real model to budget
    (["frobnicate"], "unknown subcommand"),
    (["kernels", "--device", "tpu"], "--device"),
    (["plot"], "RESULTS.json"),
])
def test_bad_options_fail_clearly(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_device_cuda_without_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--device", "cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "not available" in err


@pytest.mark.parametrize("flag", ["--results-dir", "--plots-dir"])
def test_unwritable_output_directory_fails_before_the_run(flag, tmp_path, capsys):
    """An output directory that cannot be made fails at once, not after the whole sweep."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["--workload", "ffn", "--quick", flag, str(blocker / "sub")])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_plot_missing_or_invalid_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plot", str(tmp_path / "missing.json")])
    assert e.value.code == 2
    assert "no such result file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "sweep"}))
    with pytest.raises(SystemExit):
        cli.main(["plot", str(bad)])
    assert "not a fusedrc-bench result file" in capsys.readouterr().err


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "fusedrc.bench", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0
    for opt in ("--workload", "--device", "--dtype", "--batch-sizes", "--quick", "--results-dir", "--plots-dir",
                "kernels", "--budgets", "resnet50", "opt", "models"):
        assert opt in r.stdout


def test_kernels_pattern_at_two_shapes(quick_run, tmp_path):
    """On CUDA the FFN runs at both shapes its targets name; the plot draws one panel per shape."""
    from fusedrc.bench import plot

    cuda = kernels.shapes("cuda", quick=False)
    assert [s for p, s in cuda if p == "fused_mlp"] == [dict(M=8192, d=4096, h=16384), dict(M=16384, d=1024, h=4096)]
    res, _ = quick_run
    doc = json.loads(_one(res, "kernels").read_text())
    extra = [dict(c, shape=dict(c["shape"], M=2 * c["shape"]["M"])) for c in doc["configs"] if c["pattern"] == "fused_mlp"]
    doc["configs"] += extra
    schema.validate(doc)
    (png,) = plot.plot_kernels(doc, tmp_path)
    _assert_png_not_blank(png)
    assert mpimg.imread(png).shape[1] > 4 * 4.6 * 100  # four panels side by side


def test_write_results_carries_provenance(tmp_path, monkeypatch):
    """The GPU scripts' results files (benchmarks/gpu_*.py) carry kind, time, device, versions
    and commit next to their own fields, under a timestamped name."""
    from fusedrc.bench import measure

    monkeypatch.setenv("FUSEDRC_GIT_COMMIT", "a" * 40)
    path = measure.write_results(tmp_path / "out", "tile_sweep_cpu", "tile_sweep", torch.device("cpu"),
                                 dtype="bfloat16", records=[{"x": 1}])
    assert path.parent == tmp_path / "out" and path.name.startswith("tile_sweep_cpu_") and path.suffix == ".json"
    doc = json.loads(path.read_text())
    # the commit is named from outside (a copy of the tree on a GPU machine): clean or not is unknown
    assert doc["kind"] == "tile_sweep" and doc["commit"] == "a" * 40 and doc["dirty"] is None
    monkeypatch.setenv("FUSEDRC_GIT_DIRTY", "0")
    assert measure.git_info() == ("a" * 40, False)
    assert doc["device"]["type"] == "cpu" and doc["torch"] == torch.__version__ and "timestamp" in doc
    assert doc["dtype"] == "bfloat16" and doc["records"] == [{"x": 1}]


def test_channels_last_option(tmp_path):
    """--channels-last: the image workloads' weights and inputs in channels_last, recorded in the settings."""
    from fusedrc.bench import models, workloads

    cl = torch.channels_last
    wl = workloads.build("resnet", torch.device("cpu"), torch.float32, quick=True, channels_last=True)
    assert wl.make_input(2, "cpu", torch.float32).is_contiguous(memory_format=cl)
    assert wl.model.stem[0].weight.is_contiguous(memory_format=cl)
    plain = workloads.build("resnet", torch.device("cpu"), torch.float32, quick=True)
    assert not plain.make_input(2, "cpu", torch.float32).is_contiguous(memory_format=cl)
    if models.require("resnet50") is None:
        r50 = models.build("resnet50", torch.device("cpu"), torch.float32, quick=True, channels_last=True)
        (x,), _ = r50.make_batch(2, "cpu", torch.float32)
        assert x.is_contiguous(memory_format=cl) and r50.model.conv1.weight.is_contiguous(memory_format=cl)
    res = tmp_path / "results"
    cli.main(["--workload", "resnet", "--quick", "--channels-last", "--warmup", "0", "--repeats", "1",
              "--no-progress", "--results-dir", str(res), "--plots-dir", str(tmp_path / "plots")])
    (f,) = res.glob("bench_sweep_*.json")
    doc = json.loads(f.read_text())
    schema.validate(doc)
    assert doc["settings"]["channels_last"] is True


def test_interrupted_sweep_writes_what_it_measured(tmp_path, monkeypatch):
    """A timeout's SIGTERM (turned into KeyboardInterrupt) during the second batch size: the file
    holds the first one's configurations, marked incomplete, and validates."""
    from fusedrc.bench import sweep

    real, calls = sweep._run_group, []

    def group(wl, batch, *args, **kwargs):
        calls.append(batch)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(wl, batch, *args, **kwargs)
    monkeypatch.setattr(sweep, "_run_group", group)
    res = tmp_path / "results"
    cli.main(["--workload", "ffn", "--quick", "--no-compile", "--batch-sizes", "8,16", "--warmup", "0",
              "--repeats", "1", "--no-progress", "--results-dir", str(res), "--plots-dir", str(tmp_path / "plots")])
    (f,) = res.glob("bench_sweep_*.json")
    doc = json.loads(f.read_text())
    schema.validate(doc)
    assert doc["complete"] is False and calls == [8, 16]
    assert doc["configs"] and {c["batch_size"] for c in doc["configs"]} == {8}
    assert signal.getsignal(signal.SIGTERM) is not measure._interrupt  # the handler is put back


def test_interrupted_model_sweep_keeps_its_first_batch_size(tmp_path, monkeypatch):
    """The same for a real model: a batch size measured before the interrupt is written."""
    from fusedrc.bench import models, sweep

    if why := models.require("resnet50"):
        pytest.skip(why)
    real, calls = sweep._time, []

    def timed(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(sweep, "_time", timed)
    res = tmp_path / "results"
    cli.main(["--workload", "resnet50", "--quick", "--batch-sizes", "2,3", "--warmup", "0", "--repeats", "1",
              "--no-progress", "--results-dir", str(res), "--plots-dir", str(tmp_path / "plots")])
    (f,) = res.glob("bench_sweep_*.json")
    doc = json.loads(f.read_text())
    schema.validate(doc)
    assert doc["complete"] is False and {c["batch_size"] for c in doc["configs"]} == {2}
    assert doc["workloads"]["resnet50"]["units"] > 0


def test_kernel_gemm_counts_match_the_flop_counter():
    """The GEMM counts the kernels benchmark rates eager and checkpoint by are what torch's
    FlopCounterMode measures (checkpoint's early stop never reruns an FFN's output GEMM)."""
    from torch.utils.flop_counter import FlopCounterMode

    for pattern, shape in kernels.shapes("cpu", True):
        case = kernels._Case(pattern, shape, torch.device("cpu"), torch.float32, "reference")
        for strategy in ("eager", "torch_checkpoint"):
            with FlopCounterMode(display=False) as fc:
                case.forward(strategy).backward(case.grad)
            # the Mix-FFN's depthwise conv is no GEMM unit (the counter rates it as a dense conv, groups ignored)
            flops = sum(n for op, n in fc.get_flop_counts()["Global"].items()
                        if pattern != "mix_ffn" or "convolution" not in str(op))
            assert flops == case.units[strategy] * case.gemm_flops, (pattern, strategy)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gpt_oss_experts_case(backend):
    """The kernels benchmark's gpt-oss experts (its eager loop as gpt-oss writes it) and the fused op on the same
    tensors give the same output and gradients; the GEMM counts are the flop counter's."""
    from torch.utils.flop_counter import FlopCounterMode

    shape = dict(T=24, d=16, h=12, E=4, k=2, layout="gpt_oss")
    device = torch.device("cpu")
    case = kernels._Case("moe_experts", shape, device, torch.float32, backend)
    assert case.block.gpt_oss and case.block.gate_up_proj.shape == (4, 16, 24)
    grads = {}
    with fusedrc.use_backend(backend):
        for strategy in ("eager", "fusedrc"):
            case.step(strategy)
            grads[strategy] = [case.x.grad.clone()] + [p.grad.clone() for p in case.params]
    for i, (a, b) in enumerate(zip(grads["eager"], grads["fusedrc"])):
        assert (a - b).norm() <= 1e-5 * b.norm(), i
    with FlopCounterMode(display=False) as fc:
        case.forward("torch_checkpoint").backward(case.grad)
    assert fc.get_total_flops() == case.units["torch_checkpoint"] * case.gemm_flops


def test_interrupted_kernels_run_writes_what_it_measured(tmp_path, monkeypatch):
    """A timeout's SIGTERM (KeyboardInterrupt) during the timed rounds: the file holds the pairs
    timed so far, marked incomplete, validates and redraws."""
    steps, real = [], kernels._Case.step

    def step(self, s):
        steps.append(s)
        if len(steps) == 40:
            raise KeyboardInterrupt
        return real(self, s)
    monkeypatch.setattr(kernels._Case, "step", step)
    res, plots = tmp_path / "results", tmp_path / "plots"
    # on the CPU: a GPU's do_bench ignores --warmup/--repeats and would spend the 40 steps warming up
    cli.main(["kernels", "--quick", "--device", "cpu", "--warmup", "1", "--repeats", "3", "--no-progress",
              "--results-dir", str(res), "--plots-dir", str(plots)])
    (f,) = res.glob("bench_kernels_*.json")
    doc = json.loads(f.read_text())
    schema.validate(doc)
    assert doc["complete"] is False and doc["configs"]
    assert all(len(c["times_s"]) >= 1 for c in doc["configs"])
    assert signal.getsignal(signal.SIGTERM) is not measure._interrupt  # the handler is put back
    cli.main(["plot", str(f), "--plots-dir", str(tmp_path / "redrawn")])
    assert list((tmp_path / "redrawn").glob("*.png"))


def test_conv_tradeoff_summary():
    """benchmarks/gpu_conv_tradeoff.py --summarize: per setting the geometric mean of its median over
    checkpoint's across the shapes that have both; per shape the fastest fusedrc setting."""
    import importlib
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    try:
        tradeoff = importlib.import_module("gpu_conv_tradeoff")
    finally:
        sys.path.pop(0)
    sw = dict(FWD_RECOMPUTE=False, BWD_RECOMPUTE_TWICE=True, CONV_GRAD="aten", CONV_Z="triton")
    records = [dict(shape=[1], strategy="torch_checkpoint", times_s=[2.0, 2.0, 9.0]),
               dict(shape=[1], strategy="fusedrc", **sw, times_s=[1.0, 1.0, 1.0]),
               dict(shape=[1], strategy="fusedrc", **{**sw, "CONV_Z": "aten"}, times_s=[3.0]),
               dict(shape=[2], strategy="torch_checkpoint", times_s=[1.0]),
               dict(shape=[2], strategy="fusedrc", **sw, times_s=[2.0]),
               dict(shape=[2], strategy="fusedrc", **{**sw, "CONV_Z": "aten"}, error="OutOfMemoryError"),
               dict(shape=[3], strategy="fusedrc", **sw, times_s=[5.0])]  # no checkpoint timing: left out
    out = tradeoff.summarize(records)
    default = tradeoff.setting(records[1])
    assert default == "fusedrc fwd_rc=False twice=True grad=aten z=triton"
    assert out["settings"][default] == dict(geomean=1.0, min=0.5, max=2.0, shapes=2)  # sqrt(0.5 * 2)
    assert out["settings"][tradeoff.setting(records[2])]["shapes"] == 1
    assert out["best"] == {(1,): (default, 0.5), (2,): (default, 2.0)}


def test_tile_sweep_ffn_step_runs_every_launch_switch(monkeypatch):
    """benchmarks/gpu_tile_sweep.py's ffn part on the CPU (tiny cases, one untimed call for a
    timing): eager and checkpoint recorded per pattern, then fusedrc under each launch switch that
    applies to it (TMA: the dense FFN only) with gradients matching eager's, the switches put back
    afterwards; no record is an error."""
    import importlib
    import pathlib
    import sys

    from fusedrc.kernels import _common

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    try:
        sweep = importlib.import_module("gpu_tile_sweep")
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(sweep, "_time", lambda fn, rep=100: [fn() or 1e-3])
    records = []
    cases = [("fused_mlp", dict(M=24, d=16, h=40)), ("gated_mlp", dict(M=24, d=16, h=24))]
    sweep.sweep_ffn(torch.float32, records, device="cpu", cases=cases)
    assert not any("error" in r for r in records)
    for pattern, _ in cases:
        mine = [r for r in records if r["pattern"] == pattern]
        assert [r["impl"] for r in mine[:2]] == ["eager", "torch_checkpoint"]
        # TMA loads only where a TMA path exists: the dense FFN's kernels
        expected = [v[0] for v in sweep.FFN_VARIANTS if pattern == "fused_mlp" or not v[1]]
        assert [r["variant"] for r in mine[2:]] == expected
        assert all(r["err_grads"] < 1e-4 for r in mine[2:])
        assert [r["in_table"] for r in mine[2:]] == [True] + [False] * (len(expected) - 1)
    assert (_common.GEMM_TMA, _common.GEMM_PERSISTENT) == (False, 0)


def test_host_profile_script_smoke(tmp_path, monkeypatch):
    """benchmarks/gpu_host_profile.py --smoke on the CPU: each strategy's profiled rows are written,
    fusedrc's conv op among convert(all)'s functions and not among the original model's."""
    import importlib
    import pathlib
    import sys

    from fusedrc.bench import models

    if models.require("resnet50") is not None:
        pytest.skip("needs torchvision (the test extra)")
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    try:
        script = importlib.import_module("gpu_host_profile")
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(sys, "argv", ["gpu_host_profile.py", "--smoke", "--steps", "1", "--top", "3",
                                      "--out", str(tmp_path)])
    script.main()
    (path,) = tmp_path.glob("host_profile_resnet50_cpu_*.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "host_profile" and doc["smoke"] is True
    recs = {r["strategy"]: r for r in doc["records"]}
    assert set(recs) == {"no_recompute", "torch_checkpoint", "convert_all"}
    for r in recs.values():
        assert r["wall_ms_per_step_profiled"] > 0 and r["rows"]
    assert any("conv_bn_act" in row["function"] for row in recs["convert_all"]["rows"])
    assert not any("fusedrc/ops.py" in row["function"] for row in recs["no_recompute"]["rows"])


def test_ffn_floor_script_on_committed_results(capsys):
    """benchmarks/ffn_floor.py on the committed GPU kernel results: a row per FFN shape and file, each
    floor (seven estimated GEMMs over checkpoint's step) between 0.5 and 1, consistent with its inputs."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "ffn_floor.py"
    spec = importlib.util.spec_from_file_location("ffn_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main([])
    if not rows:
        pytest.skip("no bench_kernels_cuda_*.json with fused_mlp rows committed")
    assert {r["shape"]["d"] for r in rows} >= {4096}
    for r in rows:
        assert 0.5 < r["floor"] < 1.0 and r["gemm_s"] > 0
        assert abs(7 * r["gemm_s"] / r["checkpoint_s"] - r["floor"]) < 1e-12
        assert r["gemm_s"] < r["eager_s"] / 6  # the activation passes come off the eager step
    assert "floor" in capsys.readouterr().out


def test_host_cost_experts_pattern(tmp_path):
    """benchmarks/cpu_host_cost.py --pattern experts (in a process of its own: it stubs Triton's launches and
    torch._grouped_mm for the whole process): every strategy timed, forward and backward, and the calls a step
    as the launch plans say: per expert 7 an expert with tokens (2 forward, 5 backward), grouped with
    per-expert GEMMs 2 + 5 an expert, grouped 7 in all."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_host_cost.py"
    run = subprocess.run([sys.executable, str(script), "--pattern", "experts", "--steps", "2", "--batch", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("host_cost_experts_cpu_*.json")
    doc = json.loads(path.read_text())
    records = {r["strategy"]: r for r in doc["records"]}
    assert list(records) == ["eager", "torch_checkpoint", "fusedrc per expert", "fusedrc grouped, GEMMs per expert",
                             "fusedrc grouped"]
    for r in records.values():
        assert len(r["forward_times_s"]) == len(r["backward_times_s"]) == 2
        assert all(t > 0 for t in r["forward_times_s"] + r["backward_times_s"])
    calls = {name: r["stubbed_calls_per_step"] for name, r in records.items()}
    hit = calls["fusedrc per expert"] / 7
    assert hit == int(hit) and 0 < hit <= 128
    assert calls["fusedrc grouped, GEMMs per expert"] == 2 + 5 * hit
    assert calls["fusedrc grouped"] == 7 and calls["eager"] == calls["torch_checkpoint"] == 0


def test_convert_survey_script(tmp_path):
    """benchmarks/convert_survey.py on a few model types (built on the meta device, converted): Llama's gated MLPs
    fused, nothing left; GLPN's Mix-FFNs fused; RWKV's feed-forward (a token shift and a receptance gate) fused
    round its key -> relu^2 -> value, nothing left; I-BERT's quantized intermediate listed as uncovered; a model
    type transformers cannot build from its default config a row with its error; the results
    file carries the rows, versions and commit. With --library timm: ResNet-18's 20 Conv-BN units, PVT-v2's MLPs
    fused, Visformer's SpatialMlp uncovered."""
    import importlib.util
    import json
    import subprocess
    import sys

    pytest.importorskip("transformers")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "convert_survey.py"
    run = subprocess.run([sys.executable, str(script), "--only", "llama,glpn,rwkv,ibert,autoformer", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("convert_survey_*.json")
    doc = json.loads(path.read_text())
    rows = {r["model_type"]: r for r in doc["rows"]}
    assert set(rows) == {"llama", "glpn", "rwkv", "ibert", "autoformer"} and doc["commit"] and doc["transformers"]
    assert rows["llama"]["units"]["gated_ffn"] == 2 and rows["llama"]["uncovered"] == []
    assert rows["glpn"]["units"]["mix_ffn"] > 0 and rows["glpn"]["uncovered"] == []
    assert rows["rwkv"]["units"]["ffn"] == 2 and rows["rwkv"]["uncovered"] == [] and not rows["rwkv"]["skipped"]
    assert rows["ibert"]["uncovered"] == ["IBertIntermediate"]
    assert "build_error" in rows["autoformer"]
    assert "ibert" in run.stdout and "rwkv" not in run.stdout and "5 model types" in run.stdout
    if importlib.util.find_spec("timm") is None:  # (not imported here: the script imports it its own way)
        pytest.skip("timm is not installed (test extra)")
    run = subprocess.run([sys.executable, str(script), "--library", "timm", "--only", "resnet18,pvt_v2_b0,visformer_tiny", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("convert_survey_timm_*.json")
    rows = {r["model_type"]: r for r in json.loads(path.read_text())["rows"]}
    units = rows["resnet18"]["units"]  # every one of its 20 convolutions' Conv-BN[-ReLU]
    assert sum(units.values()) == 20 and all(k.startswith("conv_bn") for k in units), units
    assert rows["pvt_v2_b0"]["units"]["mix_ffn"] == 8 and rows["pvt_v2_b0"]["uncovered"] == []
    assert rows["visformer_tiny"]["uncovered"] == ["SpatialMlp"]


def test_lora_mlp_script(tmp_path):
    """benchmarks/lora_mlp.py at a tiny size: every strategy's record (raw step times, the bytes kept) in its results
    file; fusedrc keeps x and the three dropout seeds (the adapters' terms are built inside the op, no copy kept),
    checkpoint x, eager far more; the fused step's adapter gradients are eager's when the dropout is off."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "lora_mlp.py"
    spec = importlib.util.spec_from_file_location("lora_mlp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--tokens", "64", "--d", "32", "--h", "48", "--rank", "4", "--repeats", "2",
                    "--out", str(tmp_path)])
    doc = json.loads(Path(out).read_text())
    assert doc["kind"] == "lora_mlp" and doc["commit"] and doc["shape"]["rank"] == 4
    kept = {r["strategy"]: r["saved_activation_bytes"] for r in doc["records"]}
    assert set(kept) == set(mod.STRATEGIES) and all(len(r["times_s"]) == 2 for r in doc["records"])
    x_bytes = 64 * 32 * 4
    assert kept["torch_checkpoint"] == x_bytes
    assert kept["fusedrc"] == x_bytes + 3 * 8
    assert kept["eager"] > 4 * x_bytes
    torch.manual_seed(0)
    layer = mod.LoraSublayer(32, 48, 4, 0.0, torch.float32, torch.float32, "cpu")
    x = torch.randn(64, 32)
    grads = []
    for run in (layer, layer.fused):
        run(x).square().sum().backward()
        grads.append([p.grad.clone() for p in (*layer.a.values(), *layer.b.values())])
        for p in (*layer.a.values(), *layer.b.values()):
            p.grad = None
    assert all(float((a - b).norm() / b.norm()) < 1e-5 for a, b in zip(*grads))
