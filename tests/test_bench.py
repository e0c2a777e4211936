"""fusedrc-bench: the --quick sweep runs, its JSON validates, its plots are drawn and redrawn; bad options fail clearly."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fusedrc.bench import cli, schema  # noqa: E402

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
    assert {c["pattern"] for c in doc["configs"]} == {"linear_act", "fused_mlp", "conv_bn_act"}
    assert {c["strategy"] for c in doc["configs"]} == {"eager", "torch_checkpoint", "fusedrc"}
    for c in doc["configs"]:
        assert c["tflops"] > 0 and c["flops"] > 0
        if c["strategy"] != "eager":  # the recompute is counted
            eager = next(e for e in doc["configs"] if e["pattern"] == c["pattern"] and e["strategy"] == "eager")
            assert c["flops"] > eager["flops"]
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


@pytest.mark.parametrize("argv, needle", [
    (["--workload", "nope"], "--workload"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--batch-sizes", "8,x"], "--batch-sizes"),
    (["--dtype", "int8"], "--dtype"),
    (["--repeats", "0"], "--repeats"),
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
                "kernels"):
        assert opt in r.stdout
