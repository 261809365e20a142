"""Backends: parallel modules with the same names (torch.py, tensorflow.py), chosen once by name.

A backend module provides the ops listed in ``elasticflow.ops``, plus ``NAME``, ``setup(threads, seed)``,
``is_native(obj)``/``native_kind(obj)``, ``training()``/``set_training(flag)``, the data helpers
``to_tensor``, ``resident``, ``index``, ``gather`` and ``to_numpy``, and an ``Engine`` class
(parameters, autodiff, the flat gradient buffer, optimizer, state by name) that keeps the contract
written once in ``engine.py`` (a ``typing.Protocol``; tests/test_backends.py checks every backend).

``common.py`` holds what the backends share: which backend ``elasticflow.ops`` dispatches to
(``active()``/``activate()``), the training flag, the checks of forward()'s output (each backend
passes its own "how many elements has this tensor" test), host arrays, and parameter names.
``ops`` imports the backends, never the reverse: an Engine calls ``common.activate`` with its own
module on each micro-batch, so forward()'s ``elasticflow.ops`` calls reach it whichever backend
another trainer in the process chose since.

Adding a backend is one new file here and one name in ``PACKAGES``. The TensorFlow backend has
helpers beside it, each a seam of its own: ``tensorflow_ops.py`` (its ops, which
tensorflow.py exports), ``tensorflow_data.py`` (tensors from numpy, and ``Rows``: a batch gathered
inside the compiled step), ``tensorflow_optim.py`` (torch.optim's update formulas for tf.Variables),
``tensorflow_compiled.py`` (the cheaper call of a compiled step), ``tensorflow_native.py``
(keras models and tf.Modules: variable names, frozen weights, keras's own losses, seed generators,
BatchNormalization's rules), ``tensorflow_devices.py`` (GPUs, threads, seeds, keras's dtype policy) and
``tensorflow_quiet.py`` (the first import of TF without its start-up noise). Backends know nothing
of distribution: the layers above reduce ``Engine.grad_view()`` in place.
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
    try:
        if framework == "tensorflow":  # without its start-up lines (oneDNN, absl) on the console
            from .tensorflow_quiet import import_tensorflow

            import_tensorflow()
        else:
            importlib.import_module(framework)
    except ImportError as exc:
        raise ElasticFlowError(f"backend={name} needs the '{framework}' package, which is not installed ({exc})",
                               f"install it: .venv/bin/pip install {package}") from exc
    module = importlib.import_module(f".{name}", __name__)
    _loaded[name] = module
    return module
