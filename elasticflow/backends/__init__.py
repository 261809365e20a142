"""Backends: parallel packages with the same module names (torch/, tensorflow/), chosen once by name.

A backend package (Keras 3's ``backend/{torch,tensorflow}/``) provides the ops listed in
``elasticflow.ops``, plus ``NAME``, ``setup(threads, seed, placement)``, ``gpus()``/``bf16_supported()``,
``is_native(obj)``/``modules_only(obj)``/``native_kind(obj)``/``unwrapped(model)``/``spec_from_native(opt)``,
``training()``/``set_training(flag)``, the data helpers ``to_tensor``, ``resident``, ``to_device``, ``index``,
``gather`` and ``to_numpy``, and an ``Engine`` class (parameters, autodiff, the flat gradient buffer,
optimizer, state by name) that keeps the contract written once in ``engine.py`` (a ``typing.Protocol``;
tests/test_backends.py checks every backend). Each package's ``__init__.py`` holds those names; behind
them, the same modules in each:

    ops.py      the ops, with torch's semantics and layouts
    data.py     numpy to tensors, the resident dataset, a batch on the device, rows by index
    devices.py  setup (threads, seed, this worker's GPU), gpus, bf16_supported
    native.py   the framework's own model objects (and refusing the other framework's), buffer rules
    optim.py    SGD, Adam and AdamW with torch.optim's formulas over the engine's flat buffers
    engine.py   the Engine

TensorFlow has two more: ``compiled.py`` (the cheaper call of a compiled step) and ``quiet.py`` (the
first import of TF without its start-up noise).

``common.py`` holds what the backends share: which backend ``elasticflow.ops`` dispatches to
(``active()``/``activate()``), the training flag, the checks of forward()'s output (each backend
passes its own "how many elements has this tensor" test), host arrays, parameter names and gradient
buckets. ``ops`` imports the backends, never the reverse: an Engine calls ``common.activate`` with its
own package on each micro-batch, so forward()'s ``elasticflow.ops`` calls reach it whichever backend
another trainer in the process chose since.

Adding a backend is one new package here with those modules and one name in ``PACKAGES``. Backends
know nothing of distribution: the layers above reduce ``Engine.grad_view()`` in place.
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
            # Importing the package's quiet.py runs tensorflow/__init__.py, which imports TF quietly
            # first; the call checks TF again where the package was imported before.
            from .tensorflow.quiet import import_tensorflow

            import_tensorflow()
        else:
            importlib.import_module(framework)
    except ImportError as exc:
        if (exc.name or "").startswith("elasticflow."):  # our own import failed, not the framework's
            raise
        raise ElasticFlowError(f"backend={name} needs the '{framework}' package, which is not installed ({exc})",
                               f"install it: .venv/bin/pip install {package}") from exc
    module = importlib.import_module(f".{name}", __name__)
    _loaded[name] = module
    return module
