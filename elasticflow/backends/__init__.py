"""Backends: parallel modules with the same function names (torch.py, tensorflow.py).

A backend module provides the ops listed in ``elasticflow.ops``, plus ``NAME``, ``setup(threads, seed)``,
``native_kind(obj)``, ``training()``/``set_training(flag)`` and an ``Engine`` class (parameters, autodiff,
optimizer, state). Adding a backend is one new file here and one name in ``PACKAGES``. The TensorFlow
backend has four helpers beside it, each a seam of its own: ``tensorflow_ops.py`` (its ops, which
tensorflow.py exports), ``tensorflow_optim.py`` (torch.optim's update formulas for tf.Variables),
``tensorflow_compiled.py`` (the cheaper call of a compiled step) and ``tensorflow_native.py`` (keras
models and tf.Modules).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ElasticFlowError

# backend name -> (module that must import, package to install)
PACKAGES = {"torch": ("torch", "torch==2.13.0"), "tensorflow": ("tensorflow", "tensorflow-cpu")}

_loaded: dict = {}


def load(name: str) -> ModuleType:
    """Import backend ``name`` once; a missing framework is one clear error naming the package."""
    if name in _loaded:
        return _loaded[name]
    if name not in PACKAGES:
        raise ElasticFlowError(f"unknown backend {name!r}; expected one of {', '.join(PACKAGES)}",
                               "pass backend=torch or backend=tensorflow")
    framework, package = PACKAGES[name]
    if framework == "tensorflow":  # keep TF's C++ start-up INFO lines (oneDNN, CPU features) off the console
        import os

        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        importlib.import_module(framework)
    except ImportError as exc:
        raise ElasticFlowError(f"backend={name} needs the '{framework}' package, which is not installed ({exc})",
                               f"install it: .venv/bin/pip install {package}") from exc
    module = importlib.import_module(f".{name}", __name__)
    _loaded[name] = module
    return module
