"""Every public name has a real docstring, and the docstring examples run (doctest).

Public names: ``fusedrc.__all__``, ``fusedrc.functional``, ``fusedrc.nn`` (classes and
their public methods), the ``fusedrc.convert`` module's ``__all__`` (``convert``,
``register_rule``, ...), ``fusedrc.inspect``'s entry points and ``fusedrc.bench``'s.
"""
import doctest
import importlib
import inspect
import pydoc

import pytest
import torch

import fusedrc

MIN_CHARS = 30


def _module(name):
    # fusedrc.convert is also the name of the function: import the module itself
    return importlib.import_module(name)


def _modules():
    mods = ["fusedrc", "fusedrc.functional", "fusedrc.nn", "fusedrc.convert", "fusedrc.bench"]
    if importlib.util.find_spec("triton") is not None:
        mods.append("fusedrc.inspect")  # it needs Triton to import
    return mods


def _own_doc(obj):
    """The docstring written for ``obj`` itself, not inherited nor generated."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    doc = obj.__doc__ if "__doc__" in getattr(obj, "__dict__", {}) or not inspect.isclass(obj) else None
    if inspect.isclass(obj) and doc and doc.startswith(obj.__name__ + "("):
        return None  # the signature a dataclass writes when there is no docstring
    return inspect.cleandoc(doc) if doc else None


def public_names():
    """(qualified name, object) for every public function, class, module and method."""
    seen = []
    for modname in _modules():
        mod = _module(modname)
        seen.append((modname, mod))
        assert hasattr(mod, "__all__"), f"{modname} needs __all__"
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not (callable(obj) or inspect.ismodule(obj)):
                continue  # constants (fusedrc.inspect.ARCHS, ...) are documented with #: comments
            seen.append((f"{modname}.{name}", obj))
            if inspect.isclass(obj) and obj.__module__.startswith("fusedrc"):
                for attr, value in vars(obj).items():
                    if attr.startswith("_") or attr in ("extra_repr",):
                        continue
                    if inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod, property)):
                        seen.append((f"{modname}.{name}.{attr}", value))
    return seen


PUBLIC = public_names()


def test_the_walk_finds_the_api():
    names = {n for n, _ in PUBLIC}
    for expected in ["fusedrc.recompute", "fusedrc.recompute_sequential", "fusedrc.mark", "fusedrc.unmark",
                     "fusedrc.use_backend", "fusedrc.current_backend", "fusedrc.RecomputeError",
                     "fusedrc.convert", "fusedrc.functional.linear_act", "fusedrc.functional.fused_mlp",
                     "fusedrc.functional.conv_bn_act", "fusedrc.nn.LinearReLU", "fusedrc.nn.FusedMLP",
                     "fusedrc.nn.ConvBNReLU", "fusedrc.nn.ConvBNReLU.from_modules", "fusedrc.nn.FusedMLP.forward",
                     "fusedrc.convert.register_rule", "fusedrc.convert.saved_bytes", "fusedrc.bench.main"]:
        assert expected in names, expected


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_public_name_has_a_docstring(name, obj):
    doc = _own_doc(obj)
    assert doc, f"{name} has no docstring of its own"
    assert len(doc) >= MIN_CHARS and len(doc.split()) >= 5, f"{name}'s docstring is too short: {doc!r}"


def test_help_recompute_shows_an_example():
    text = pydoc.render_doc(fusedrc.recompute, renderer=pydoc.plaintext)
    assert "Example" in text and ">>> " in text and "fusedrc.recompute(" in text
    assert "use_reentrant" in text and "RecomputeError" in text


def _examples():
    finder = doctest.DocTestFinder(recurse=False)
    out = []
    for name, obj in PUBLIC:
        target = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
        if inspect.ismodule(target) or isinstance(target, property):
            continue
        for test in finder.find(target, name, globs={}):
            if test.examples:
                out.append((name, test))
    return out


EXAMPLES = _examples()


def test_recompute_has_a_doctest():
    assert "fusedrc.recompute" in {n for n, _ in EXAMPLES}


@pytest.mark.parametrize("name,test", EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_docstring_examples_run(name, test):
    """Each docstring example runs and prints what it shows, so the docs cannot rot."""
    torch.manual_seed(0)
    test.globs = {"torch": torch, "fusedrc": fusedrc}
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with fusedrc.use_backend("reference"):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
