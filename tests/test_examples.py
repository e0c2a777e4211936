"""The README's examples run as written (small arguments: the point is that they work and that
the converted model trains like the original, which each example checks itself: exit status 1
when the losses differ)."""
import importlib.util
import sys
from pathlib import Path

import pytest

import fusedrc
from fusedrc.convert import import_torchvision

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _main(name):
    sys.path.insert(0, str(EXAMPLES))  # the examples import their shared _compare
    try:
        spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module.main


@pytest.fixture(autouse=True)
def _restore_backend():
    yield
    fusedrc.use_backend("auto")


def test_train_small(capsys):
    assert _main("train_small")(["--steps", "15", "--dim", "32", "--hidden", "64", "--blocks", "2",
                                 "--seq", "8", "--device", "cpu"]) in (0, None)
    assert "last loss" in capsys.readouterr().out


def test_train_resnet(capsys):
    try:
        import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed (test extra)")
    assert _main("train_resnet")(["--size", "32", "--batch", "2", "--steps", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "saved-bytes ratio converted/original" in out and "conv1" in out
    assert _main("train_resnet")(["--model", "efficientnet_b0", "--size", "32", "--batch", "2", "--steps", "2",
                                  "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    ratio = float(out.rsplit("saved-bytes ratio converted/original:", 1)[1].split()[0])
    assert out.count("conv_bn_act") == 33 and ratio < 1.0
    assert _main("train_resnet")(["--model", "densenet121", "--size", "32", "--batch", "2", "--steps", "2",
                                  "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    ratio = float(out.rsplit("saved-bytes ratio converted/original:", 1)[1].split()[0])
    assert out.count("bn_relu_conv") == 2 * 58 + 3 and ratio < 0.7


@pytest.mark.parametrize("arch, unit", [("opt", "fc1"), ("llama", "mlp"), ("gpt2", "mlp"), ("mixtral", "experts")])
def test_train_causal_lm(arch, unit, capsys):
    try:
        import_torchvision()  # transformers imports torchvision when it is installed
    except ImportError:
        pass
    pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
    assert _main("train_opt")(["--arch", arch, "--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "2",
                               "--steps", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    ratio = float(out.rsplit("saved-bytes ratio converted/original:", 1)[1].split()[0])
    assert f".{unit} " in out and ratio < 1.0


@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_train_causal_lm_with_lora(dropout, capsys):
    """--lora: PEFT's all-linear adapters; Llama's MLPs fused with them (losses as PEFT's: all steps without
    dropout, the first with it), fewer bytes kept."""
    try:
        import_torchvision()
    except ImportError:
        pass
    pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
    pytest.importorskip("peft", reason="peft is not installed (test extra)")
    assert _main("train_opt")(["--arch", "llama", "--lora", "4", "--lora-dropout", dropout, "--layers", "2",
                               "--hidden", "32", "--seq", "16", "--batch", "2", "--steps", "3", "--device",
                               "cpu"]) == 0
    out = capsys.readouterr().out
    ratio = float(out.rsplit("saved-bytes ratio converted/original:", 1)[1].split()[0])
    assert ".mlp " in out and "LoRA r=4" in out and ratio < 0.7
